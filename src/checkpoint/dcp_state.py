"""A model's and its optimizer's state as torch.distributed.checkpoint (DCP) reads and writes
it: keyed by parameter name, each process holding its own shards (of a plain, DDP or FSDP2
model, or one of DTensor parameters). DCP is imported where used: importing it costs a run's
start-up about a fifth of `import torch`, and only sharded checkpoints need it."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn


def dcp_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """DCP's state_dict APIs' `model` and `optimizer` (unless None), this process's shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    if optimizer is None:
        return {"model": get_model_state_dict(model, options=StateDictOptions())}
    model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions())
    return {"model": model_state, "optimizer": optimizer_state}


def read_dcp(state: dict[str, Any], path: str) -> None:
    """DCP reads the checkpoint at `path` into `state`'s tensors (or views of them), this
    process's shards of each, however many processes wrote them."""
    import torch.distributed.checkpoint as dcp

    from src.checkpoint.sharded_progress import LoadPlannerShowingProgress

    with warnings.catch_warnings():
        # One process without a process group reads every shard itself, as meant here; DCP
        # warns that it assumes so on every such load (eval.py, resume under single).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        showing = LoadPlannerShowingProgress(f"reading checkpoint {os.path.basename(path)}")
        dcp.load(state, checkpoint_id=path, planner=showing)
        showing.finish()


def set_dcp_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any], key: str
) -> None:
    """Put `state` (`dcp_state_dict`'s, as read) into `model` and `optimizer`: the model alone
    when `optimizer` is None, the optimizer alone when `key` is another than "optimizer" (the
    weight average's, `ema`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    options = StateDictOptions()
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
    elif key != "optimizer":
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )
