"""`parallel=ddp`: DistributedDataParallel, one process and one model replica per device.

Each rank runs the loop on `global batch / world size` samples; DDP averages the gradients
across ranks during backward (bucketed all-reduce overlapping with it), so every replica takes
the same optimizer step that `single` takes on the whole batch.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.strategies.distributed import Distributed


class DDP(Distributed):
    def wrap(self, model: nn.Module) -> nn.Module:
        return DistributedDataParallel(
            model.to(self.device),
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            # The template's models hold no running statistics, so there is nothing to
            # sync before every forward pass (one collective per step saved).
            forward_sync_buffers=False,
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if enabled else model.no_sync()
