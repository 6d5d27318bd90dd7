"""The model's outputs for every sample of an evaluated split (`eval.py predict=true`), under
any strategy, in dataset order: predictions.pt holds `indices` (0, 1, ..., N-1) and `outputs`
(the model's outputs, a tensor or a tuple/dict of them, sample i's at position i).

However a strategy splits a batch (DataParallel's scatter, pipeline micro-batches, each rank's
share), its loss function gets each part's outputs with that part's targets. So the batch's
positions go in as the targets: each part's outputs arrive with the positions they belong to,
and the task's sums still get the real targets, taken at those positions. Each process writes
what it kept; the main process merges them, drops repeats (tensor-parallel peers compute the
same samples) and puts them in dataset order. Padding batches (a rank short of samples) are
not kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from src.components.batches import Tree, batch_size, concat, move, take, tensors
from src.components.tasks import Task
from src.parallel.base import Strategy

CPU = torch.device("cpu")


class SampleOutputs:
    """One process's outputs of the samples it evaluated, with their sample indices."""

    def __init__(self) -> None:
        self.indices: list[torch.Tensor] = []
        self.outputs: list[Tree] = []

    def apply(
        self,
        model: nn.Module,
        strategy: Strategy,
        task: Task,
        inputs: Tree,
        targets: Tree,
        samples: torch.Tensor,
    ) -> torch.Tensor:
        """`strategy.apply(model, inputs, targets, task.sums)`, keeping the outputs of the batch
        of the samples `samples` (none: a padding batch, whose outputs are dropped)."""
        parts: list[tuple[torch.Tensor, Tree]] = []  # appended from DataParallel's threads too
        on = tensors(targets)[0].device

        def sums(outputs: Tree, positions: torch.Tensor) -> torch.Tensor:
            parts.append((positions.to(CPU), move(outputs, CPU)))
            device = tensors(outputs)[0].device
            return task.sums(outputs, move(take(targets, positions.to(on)), device))

        result = strategy.apply(model, inputs, torch.arange(batch_size(targets)), sums)
        if len(samples):
            for positions, outputs in parts:
                self.indices.append(samples[positions])
                self.outputs.append(outputs)
        return result

    def write(self, strategy: Strategy, path: Path, samples: int) -> None:
        """Every process's outputs of the split's `samples` samples, in dataset order, to `path`:
        each process writes its own beside it, the main process merges them."""
        process = strategy.ranks.rank if strategy.ranks is not None else 0
        own = path.with_name(f".{path.stem}-process{process}.pt")
        none = torch.empty(0, dtype=torch.long)
        kept = {
            "indices": torch.cat(self.indices) if self.indices else none,
            "outputs": concat(self.outputs) if self.outputs else None,
        }
        torch.save(kept, own)
        strategy.barrier()  # every process's file is written
        if not strategy.is_main:
            return
        found = sorted(path.parent.glob(f".{path.stem}-process*.pt"))
        parts = [torch.load(file, weights_only=True) for file in found]
        torch.save(in_dataset_order(parts, samples), path)
        for file in found:
            file.unlink()


def in_dataset_order(parts: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """The processes' `parts` ({indices, outputs} each) as one, sorted by sample index, each
    sample once; every one of the split's `samples` must be there."""
    indices = torch.cat([part["indices"] for part in parts])
    outputs = concat([part["outputs"] for part in parts if part["outputs"] is not None])
    order = torch.argsort(indices, stable=True)
    ordered = indices[order]
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]  # a sample's repeats (tp peers) after its first
    order, ordered = order[first], ordered[first]
    if not torch.equal(ordered, torch.arange(samples)):
        raise RuntimeError(f"predictions cover {len(ordered)} of the split's {samples} samples")
    return {"indices": ordered, "outputs": take(outputs, order)}
