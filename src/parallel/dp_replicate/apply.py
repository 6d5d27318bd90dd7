"""How the data-parallel degree `dp_replicate` alone (`parallel=ddp`, `hybrid`) runs: torch's
DistributedDataParallel, its checks and `apply_ddp` with the reducer's options.

Each rank runs the loop on `global batch / replicas` samples; DDP averages the gradients across
ranks during backward (bucketed all-reduce overlapping with it), so every replica takes the same
optimizer step that `single` takes on the whole batch. Buffers (BatchNorm running statistics) are
rank 0's on every rank before each training forward pass, unless
`parallel.broadcast_buffers=false`; the checkpoint holds rank 0's. The reducer's options
(`bucket_cap_mb`, `find_unused_parameters`, `static_graph`, `gradient_as_bucket_view`,
`broadcast_buffers`) mean something only here: `check_reducer_options` refuses them elsewhere.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import fields
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.config.base import ConfigError
from src.config.parallel import MeshConfig, ReducerConfig

# The reducer's options as the schema defaults them: set otherwise, they ask for DDP.
REDUCER_DEFAULTS = {option.name: option.default for option in fields(ReducerConfig)}


def check_reducer_options(cfg: MeshConfig, layout_label: str) -> None:
    """ConfigError, in one line, for a reducer option set under a layout that DDP does not run
    (`layout_label`: the layout by its degrees)."""
    changed = [
        f"parallel.{name}={json.dumps(getattr(cfg, name))}"  # as written: true, not True
        for name, default in REDUCER_DEFAULTS.items()
        if getattr(cfg, name) != default
    ]
    if changed:
        raise ConfigError(
            f"{', '.join(changed)}: DDP's reducer options, but the layout {layout_label} is not "
            "dp_replicate alone and runs FSDP2; leave them at their defaults, or use parallel=ddp"
        )


def check_accumulate(cfg: MeshConfig, accumulate: int) -> None:
    # torch's reducer fails an internal assert on the backward after no_sync() when the graph
    # is static (torch 2.14.1, also in plain DDP), after the job has started.
    if cfg.static_graph and accumulate > 1:
        raise ConfigError(
            f"parallel.static_graph=true cannot run with trainer.accumulate={accumulate}: "
            "torch's DDP fails on the micro-steps that skip the gradient sync; set "
            "parallel.static_graph=false or trainer.accumulate=1"
        )


def apply_ddp(
    module: nn.Module, device_ids: list[int] | None, cfg: MeshConfig
) -> DistributedDataParallel:
    """`module` under DDP with the reducer options of `cfg` (`device_ids` None: a module on the
    CPU or on several devices, whose inputs DDP leaves where they are)."""
    return DistributedDataParallel(
        module, device_ids=device_ids, **buffer_sync(cfg.broadcast_buffers), **reducer_options(cfg)
    )


def release_reducer(replica: DistributedDataParallel | None) -> None:
    """Before the process group is destroyed. DDP's reducer holds the process group, and a DDP
    module sits in reference cycles, so the reducer dies whenever the cyclic GC gets to it,
    possibly after the group was destroyed: then, as the group's last holder, it destroys the
    group under the GIL, joining gloo's worker threads while one of them waits for the GIL to
    free the last collective's tensors, a deadlock (pytorch/pytorch#56297; reproduced here
    within 100 init/train/destroy rounds, also with a barrier before destroy_process_group).
    Taken from it now, the group dies with its Python handle, whose destructor releases the
    GIL."""
    if replica is not None:
        replica.reducer = replica.logger = replica.process_group = None


def reducer_options(cfg: MeshConfig) -> dict[str, Any]:
    """`parallel.find_unused_parameters`, `static_graph`, `gradient_as_bucket_view` and
    `bucket_cap_mb`, as DistributedDataParallel takes them (a bucket size only when set)."""
    options: dict[str, Any] = {
        "find_unused_parameters": cfg.find_unused_parameters,
        "static_graph": cfg.static_graph,
        "gradient_as_bucket_view": cfg.gradient_as_bucket_view,
    }
    if cfg.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = cfg.bucket_cap_mb
    return options


def buffer_sync(broadcast: bool) -> dict[str, bool]:
    """The keyword that gives DDP `parallel.broadcast_buffers`: torch 2.13 renamed
    `broadcast_buffers` (which now warns) to `forward_sync_buffers`; torch 2.11 and 2.12 know only
    the old name. With false, the new one still starts every rank from rank 0's buffers, the old
    one from each rank's own (equal for models built from the seed)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": broadcast}
    return {"broadcast_buffers": broadcast}
