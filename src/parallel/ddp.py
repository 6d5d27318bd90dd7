"""`parallel=ddp`: DistributedDataParallel, one process and one model replica per device.

Each rank runs the loop on `global batch / world size` samples; DDP averages the gradients
across ranks during backward (bucketed all-reduce overlapping with it), so every replica takes
the same optimizer step that `single` takes on the whole batch. Buffers (BatchNorm running
statistics) are rank 0's on every rank before each training forward pass, unless
`parallel.broadcast_buffers=false`; the checkpoint holds rank 0's.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.config.base import ConfigError
from src.config.parallel import DDPConfig
from src.parallel.base import DeviceShare, Messages, ModelSizes, bucketed_all_reduce, ring_bytes
from src.parallel.distributed import Distributed


class DDP(Distributed):
    settings_schema = DDPConfig
    sharded_checkpoints = True
    replica: DistributedDataParallel | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        cuda = self.device.type == "cuda"
        model = self.with_batchnorm_synced(model).to(self.device)
        return self.replicate(model, [self.device.index] if cuda else None)

    def replicate(self, module: nn.Module, device_ids: list[int] | None) -> nn.Module:
        """`module` under DDP, kept so that `teardown` can take the process group from it."""
        self.replica = DistributedDataParallel(
            module,
            device_ids=device_ids,
            **buffer_sync(self.cfg.broadcast_buffers),
            **reducer_options(self.cfg),
        )
        return self.replica

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def check_accumulate(self, accumulate: int) -> None:
        # torch's reducer fails an internal assert on the backward after no_sync() when the
        # graph is static (torch 2.14.1, also in plain DDP), after the job has started.
        if self.cfg.static_graph and accumulate > 1:
            raise ConfigError(
                f"parallel.static_graph=true cannot run with trainer.accumulate={accumulate}: "
                "torch's DDP fails on the micro-steps that skip the gradient sync; set "
                "parallel.static_graph=false or trainer.accumulate=1"
            )

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if enabled else model.no_sync()

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        """Rank 0's device: the whole model on its share of the batch, plus the reducer's
        buckets, a second copy of the gradients (none when the gradients are views into them)."""
        buckets = 0 if self.cfg.gradient_as_bucket_view else sizes.parameter_bytes
        share = DeviceShare(
            f"{self.device_type}:0",
            micro_batch // self.world_size,
            extra_bytes={"gradients": buckets},
        )
        return [share]

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        return {"gradient all-reduce": ring_bytes(sizes.parameter_bytes, self.world_size)}

    def step_messages(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> list[Messages]:
        """The gradients' bucketed all-reduce, once per step (no_sync skips the others)."""
        return [bucketed_all_reduce(sizes.parameter_bytes, self.world_size)]

    def teardown(self) -> None:
        # DDP's reducer holds the process group, and a DDP module sits in reference cycles, so
        # the reducer dies whenever the cyclic GC gets to it, possibly after the group was
        # destroyed: then, as the group's last holder, it destroys the group under the GIL,
        # joining gloo's worker threads while one of them waits for the GIL to free the last
        # collective's tensors, a deadlock (pytorch/pytorch#56297; reproduced here within 100
        # init/train/destroy rounds, also with a barrier before destroy_process_group). Taken
        # from it now, the group dies with its Python handle, whose destructor releases the GIL.
        if self.replica is not None:
            self.replica.reducer = self.replica.logger = self.replica.process_group = None
        super().teardown()


def reducer_options(cfg: DDPConfig) -> dict[str, Any]:
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
