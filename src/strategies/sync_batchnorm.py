"""`parallel.sync_batchnorm`: BatchNorm with statistics over the global batch, as `single` has.

Plain BatchNorm on a data-parallel rank normalises by its own share of the batch and updates its
running statistics from that share. torch's `nn.SyncBatchNorm` sums the statistics over the ranks
instead, but only on GPUs; on CPU (gloo) the same sums are taken here with an all-reduce that
autograd differentiates (its gradient is the all-reduce of the gradients), so every rank
normalises, and updates its running statistics, exactly as `single` does on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn


class SyncBatchNorm(nn.SyncBatchNorm):
    """torch's SyncBatchNorm, with the global statistics summed by gloo for CPU inputs."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.device.type != "cpu" or not (self.training and dist.is_initialized()):
            return super().forward(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        count = input.new_tensor([input.numel() // channels])
        local = torch.cat([input.sum(dims), input.square().sum(dims), count])
        total = dist_nn.all_reduce(local)
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels : 2 * channels] / n - mean.square()
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = self.momentum
                if momentum is None:  # a cumulative average, as BatchNorm's
                    momentum = 1.0 / self.num_batches_tracked.item()
                unbiased = var * n / (n - 1)
                self.running_mean.lerp_(mean, momentum)
                self.running_var.lerp_(unbiased, momentum)
        shape = [1, channels] + [1] * (input.dim() - 2)
        normalised = (input - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            normalised = normalised * self.weight.view(shape) + self.bias.view(shape)
        return normalised


def convert_sync_batchnorm(model: nn.Module) -> nn.Module:
    """`model` with every BatchNorm layer made a `SyncBatchNorm` (same parameters and buffers,
    so the same state_dict)."""
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for module in converted.modules():
        if type(module) is nn.SyncBatchNorm:
            module.__class__ = SyncBatchNorm  # adds behaviour only, no state
    return converted
