"""`parallel.deferred_batchnorm`: torchgpipe's deferred BatchNorm, for the pipelines.

A pipeline over M micro-batches runs each BatchNorm M times a step. Plain BatchNorm then updates
its running statistics M times, each from one micro-batch. Deferred, as torchgpipe's
`DeferredBatchNorm` does it, each micro-batch is still normalised by its own statistics (what
trains the weights: as `single` with `trainer.accumulate=M`), but the running statistics are
updated once a step, from the statistics of the whole batch: what `single` would record from the
same BatchNorm inputs. The blocks keep their classes' state_dict keys.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class Deferred(_BatchNorm):
    """Mixed into a BatchNorm class by `defer_batchnorm`; `chunks` micro-batches make a step."""

    chunks: int

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._track(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _track(self, input: torch.Tensor) -> None:
        dims = [0, *range(2, input.dim())]
        sums = torch.stack([input.sum(dims), (input * input).sum(dims)]).double()
        tracked = getattr(self, "_tracked", None)
        self._tracked = sums if tracked is None else tracked + sums
        self._count = getattr(self, "_count", 0) + input.numel() // input.size(1)
        self._seen = getattr(self, "_seen", 0) + 1
        if self._seen == self.chunks:
            self._commit()

    def _commit(self) -> None:
        """One update of the running statistics from the step's whole batch."""
        count = self._count
        mean = self._tracked[0] / count
        variance = (self._tracked[1] / count - mean * mean) * count / max(count - 1, 1)
        self.num_batches_tracked.add_(1)
        momentum = self.momentum
        if momentum is None:  # a cumulative average, as BatchNorm's momentum=None
            momentum = 1.0 / self.num_batches_tracked.item()
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(variance.to(self.running_var.dtype), momentum)
        self._tracked, self._count, self._seen = None, 0, 0


@functools.cache
def deferred_class(batchnorm_class: type[_BatchNorm]) -> type[_BatchNorm]:
    return type(f"Deferred{batchnorm_class.__name__}", (Deferred, batchnorm_class), {})


def defer_batchnorm(model: nn.Module, chunks: int) -> nn.Module:
    """Every BatchNorm of `model` deferred over `chunks` micro-batches a step, in place."""
    for module in model.modules():
        if isinstance(module, _BatchNorm) and not isinstance(module, Deferred):
            module.__class__ = deferred_class(type(module))
            module.chunks = chunks
    return model
