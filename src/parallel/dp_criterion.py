"""`parallel=dp_criterion`: DataParallelModel + DataParallelCriterion (the PyTorch-Encoding
design). Like `parallel=dp`, but the replicas' outputs are never gathered: the targets are
scattered the same way, each device computes the loss of its own part in a parallel thread, and
only the per-device losses (scalars) travel to the output device. Autograd flows from that sum
back into every replica. The output device no longer holds the whole batch's outputs and their
gradient, which is what makes plain DP run out of memory on large outputs.

Unlike the original, which averages per-device mean losses (wrong when the batch splits
unevenly), the parts' loss *sums* are added: divided by the global count in the loop, that is the
exact mean over the batch for any split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from src.components.batches import Tree, batch_size
from src.parallel.base import LossFn
from src.parallel.dp import DP
from src.parallel.mechanisms.replicas import parallel_apply, scatter


def parallel_criterion(
    fn: LossFn, outputs: Sequence[Any], targets: Tree, devices: Sequence[torch.device]
) -> torch.Tensor:
    """Sum of `fn(outputs[i], targets' part i)` over the parts, each computed on `devices[i]` in
    its own thread, added on `devices[0]`. `outputs` are a replicated model's per-device outputs
    (tensors, tuples or dicts), `targets` the whole batch's (a tensor, tuple or dict), split as
    the inputs were."""
    parts = scatter(targets, devices)
    if len(parts) != len(outputs):
        raise ValueError(
            f"{batch_size(targets)} targets split into {len(parts)} parts for {len(outputs)} "
            "outputs"
        )
    losses = parallel_apply([fn] * len(parts), list(zip(outputs, parts, strict=True)), devices)
    return torch.stack([loss.to(devices[0]) for loss in losses]).sum(0)


class DPCriterion(DP):
    gather_outputs = False

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        outputs = model(inputs)
        return parallel_criterion(fn, outputs, targets, self.devices[: len(outputs)])
