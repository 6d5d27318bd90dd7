"""`parallel.sync_batchnorm`: BatchNorm with statistics over the global batch, as `single` has.

Plain BatchNorm on a data-parallel rank normalises by its own share of the batch and updates its
running statistics from that share. torch's `nn.SyncBatchNorm` sums the statistics over the ranks
instead, but only on GPUs (DDP refuses it on CPU modules); on CPU (gloo) `GlooSyncBatchNorm`
takes the sums, and then the centred sums of squares, with all-reduces that autograd
differentiates (their gradient is the all-reduce of the gradients), so every rank normalises, and
updates its running statistics, as `single` does on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class GlooSyncBatchNorm(_BatchNorm):
    """BatchNorm over any (batch, channels, ...) input, its training statistics summed over the
    default process group (any backend, CPU tensors included)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected (batch, channels, ...) input, got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized()):
            return super().forward(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        shape = [1, channels] + [1] * (input.dim() - 2)
        count = input.new_tensor([input.numel() // channels])
        total = dist_nn.all_reduce(torch.cat([input.sum(dims), count]))
        n = total[-1]
        mean = total[:channels] / n
        # The variance from a second, centred pass: E[x^2] - E[x]^2 of summed squares cancels
        # in a channel whose variance is small against its mean.
        centred = input - mean.view(shape)
        var = dist_nn.all_reduce(centred.square().sum(dims)) / n
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = self.momentum
                if momentum is None:  # a cumulative average, as BatchNorm's
                    momentum = 1.0 / self.num_batches_tracked.item()
                unbiased = var * n / (n - 1)
                self.running_mean.lerp_(mean, momentum)
                self.running_var.lerp_(unbiased, momentum)
        normalised = centred / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            normalised = normalised * self.weight.view(shape) + self.bias.view(shape)
        return normalised


def convert_sync_batchnorm(model: nn.Module, device_type: str) -> nn.Module:
    """`model` with every BatchNorm layer synchronised: torch's SyncBatchNorm on CUDA,
    `GlooSyncBatchNorm` on CPU. Same parameters and buffers, so the same state_dict."""
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            module.__class__ = GlooSyncBatchNorm  # same state (a _BatchNorm's), another forward
    return model
