"""One process's build of an experiment, twice: on the meta device here (`build_blueprint`:
data, task and a model of shapes only, so that whatever can fail on bad input fails before any
process, device or tracker is touched), then for real (`Trainer.build`, `trainer.py`: the model,
its wrapping, optimizer and checkpoint), reusing the first's data and task. A launcher runs only
the first (`check_config`: the settings' checks, then that). Which process runs what is
`src/launch/job.py`'s.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from src.checkpoint.store import is_sharded, load_checkpoint, resume_path
from src.components.blocks import prepare_blocks
from src.components.data import build_data
from src.components.data_contract import Data, first_samples
from src.components.model_contract import build_model as build_model_of
from src.components.state_dicts import tied_keys
from src.components.tasks import build_task
from src.config.job import JobConfig, job_config
from src.config.trainer import TrainerConfig
from src.parallel.base import Strategy
from src.runtime.progress import PhaseProgress, show_progress_every, size_text
from src.runtime.ranks import Ranks
from src.training.checks import blame, check_data, check_model, check_settings
from src.training.init_from import check_init_weights, init_from_path, load_init_weights
from src.training.resume import check_resumable


@dataclass
class Blueprint:
    """What the up-front build on the meta device settled, for the real build to reuse."""

    data: Data
    task: Any
    meta_model: nn.Module  # shapes only
    checkpoint: Path | None  # to resume from
    saved: dict[str, Any] | None  # its structure; a full checkpoint's tensors memory-mapped
    init_from: Path | None  # weights to start from, when there is no checkpoint to resume


def model_description(blueprint: Blueprint) -> dict[str, Any]:
    """What an export needs to rebuild the model besides its config (src/checkpoint/export.py),
    kept in each checkpoint's train state."""
    data, model = blueprint.data, blueprint.meta_model
    return {
        "model_args": {"input_shape": list(data.input_shape), "num_classes": data.num_classes},
        "tied_keys": tied_keys(model),
        # The weight average's parameter indices name these (`export.averaged_weights`).
        "parameter_keys": [name for name, _ in model.named_parameters()],
        # A sharded checkpoint's tensors read back in the order its ranks wrote them.
        "state_dict_keys": list(model.state_dict()),
    }


def build_blueprint(
    job: JobConfig, run_dir: Path, strategy: Strategy, checked: Path | None = None
) -> Blueprint:
    """Build data, task and model (on the meta device: no memory, no compute) and check them:
    whatever their builders reject fails here, as does a model output the task cannot take, a
    model the strategy cannot place (which also settles a pipeline's stage split), and a
    checkpoint to resume or weights to start from (trainer.init_from) that do not fit.
    `checked`: the checkpoint to resume from as the launcher found it, files checksummed: a rank
    neither looks for it nor reads its checksums again."""
    trainer = job.trainer
    data, task, model = build_checked_parts(job, strategy)
    checkpoint = checked or resume_path(trainer.resume, run_dir, announce=True)
    saved = load_checkpoint(checkpoint, mmap=True) if checkpoint is not None else None
    if saved is not None:
        check_resumable(saved, checkpoint, model, job)
    # A resumed fine-tune continues from its checkpoint: trainer.init_from only starts a run.
    init_from = None
    if checkpoint is None and trainer.init_from is not None:
        init_from = init_from_path(trainer.init_from)
        check_init_weights(model, init_from, trainer.init_strict)
    return Blueprint(data, task, model, checkpoint, saved, init_from)


def build_checked_parts(job: JobConfig, strategy: Strategy) -> tuple[Data, Any, nn.Module]:
    """Data, task and the model on the meta device, checked against each other and the
    strategy. From here on, this process's long phases show progress as trainer.progress_every_s
    says."""
    cfg = job.cfg
    show_progress_every(job.trainer.progress_every_s)
    with blame("data"):
        data = build_data(cfg.data, cfg.seed)
    check_data(job, data, strategy.data_shards)
    with blame("task"):
        task = build_task(cfg.task)
    model = build_model(cfg, data, torch.device("meta"))
    check_model(job, strategy, model, task, data)
    return data, task, model


def check_config(
    cfg: DictConfig | JobConfig, run_dir: Path, ranks: Ranks | None = None
) -> Strategy:
    """Every check that needs no process or device work (the launcher's, before it starts any
    rank), of a composed config or a typed one; returns the unstarted strategy."""
    job = job_config(cfg)
    strategy = check_settings(job, ranks)
    build_blueprint(job, run_dir, strategy)
    return strategy


def build_model(cfg: DictConfig, data: Data, device: torch.device | None = None) -> nn.Module:
    """`cfg.model` for `data`'s shapes, on `device` (None: the CPU, initialised from the RNG)."""
    with blame("model"), torch.device(device or "cpu"):
        return build_model_of(cfg.model, data.input_shape, data.num_classes)


def set_numerics(trainer: TrainerConfig, device_type: str) -> str:
    """This process's math settings for the run; returns the float32 matmul precision in use.

    Set on every run, not left as found: the jobs of a multirun share one process."""
    if trainer.deterministic:
        # cuBLAS is only deterministic with a fixed workspace (torch reproducibility notes).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(trainer.deterministic)
    # TF32 on CUDA: an fp32 8192^3 matmul took 21.5 ms at "highest" and 2.7 ms at "high" on an
    # H200. CPUs keep true fp32 unless asked, so that CPU runs stay comparable bit for bit.
    precision = trainer.matmul_precision
    if precision == "auto":
        precision = "high" if device_type == "cuda" else "highest"
    torch.set_float32_matmul_precision(precision)
    # Input shapes repeat every step, so cuDNN's one-time search for the fastest convolution
    # algorithm pays off; it is non-deterministic, so not with trainer.deterministic.
    torch.backends.cudnn.benchmark = device_type == "cuda" and not trainer.deterministic
    return precision


def size_lazy_modules(model: nn.Module, data: Data) -> None:
    """Give lazy modules (`nn.LazyLinear`, ...) their sizes with a forward pass on two training
    samples, before any strategy copies, splits or shards the model: they cannot size
    themselves later (DDP and FSDP refuse them). Every process does this alike, so the draws of
    their initialisation are the same for every strategy."""
    if not any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
        return
    model.eval()
    with torch.no_grad():
        model(first_samples(data.train, 2)[0])
    model.train()


def build_wrapped_model(
    job: JobConfig,
    strategy: Strategy,
    data: Data,
    state: dict[str, Any] | None,
    init_from: Path | None = None,
) -> nn.Module:
    """The model, seeded (so every strategy starts from single's weights), with the weights of
    a full checkpoint's `state` if given, or else of `init_from` (trainer.init_from's), prepared
    per block and wrapped by the strategy. (A sharded checkpoint is loaded into the wrapped
    model: `strategy.load_sharded`.)"""
    trainer = job.trainer
    torch.manual_seed(job.cfg.seed)
    model = build_model(job.cfg, data)
    size_lazy_modules(model, data)
    if state is not None:
        load_showing_progress(model, state["model"])
    if init_from is not None:
        load_init_weights(model, init_from, trainer.init_strict, announce=strategy.is_main)
    prepare_blocks(model, trainer.activation_checkpointing, trainer.compile, trainer.checkpoint_ops)
    return strategy.wrap(model)


def load_showing_progress(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """`model.load_state_dict(weights)`, where a checkpoint's memory-mapped tensors are read
    from disk: a long read shows its progress in bytes, module by module (each module's own
    tensors counted as it starts loading them)."""
    total = sum(tensor.nbytes for tensor in weights.values())
    with PhaseProgress("reading the checkpoint's weights", total, size_text) as progress:

        def loading(module: nn.Module, *_: Any) -> None:
            own = itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
            progress.advance(sum(tensor.nbytes for tensor in own))

        hooks = [module.register_load_state_dict_pre_hook(loading) for module in model.modules()]
        try:
            model.load_state_dict(weights)
        finally:
            for hook in hooks:
                hook.remove()


def checkpoint_to_load(blueprint: Blueprint, strategy: Strategy) -> tuple[dict | None, bool]:
    """The checkpoint's state, and whether its tensors go straight into the wrapped model, each
    rank reading its own shards (a sharded checkpoint, for a strategy that can). A full one (or a
    sharded one for a strategy that cannot, then read whole here) is loaded before `wrap`."""
    if blueprint.checkpoint is None:
        return None, False
    in_shards = is_sharded(blueprint.checkpoint)
    if in_shards and not strategy.sharded_checkpoints:
        return load_checkpoint(blueprint.checkpoint), False
    return blueprint.saved, in_shards
