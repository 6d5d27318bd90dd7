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

import torch
from torch import nn

from src.components.batches import Tree
from src.parallel.base import LossFn
from src.parallel.replicas.apply import parallel_criterion
from src.parallel.strategies.dp import DP


class DPCriterion(DP):
    gather_outputs = False

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        outputs = model(inputs)
        return parallel_criterion(fn, outputs, targets, self.devices[: len(outputs)])
