"""Progress of a sharded (DCP) checkpoint's write or read: this process's share of the tensors,
piece by piece, as torch's writer asks its planner for each piece to write (`resolve_data`) and
its reader hands each piece read to it (`commit_tensor`). Rank 0 shows its own share, which
runs beside the others'. Imported only for sharded checkpoints: DCP is slow to import.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
)

from src.runtime.progress import PhaseProgress, size_text


def written_bytes(item: WriteItem) -> int:
    """A tensor piece's bytes (0 for DCP's other items: pickled values, small)."""
    data = item.tensor_data
    return 0 if data is None else math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


class ShowingProgress:
    """A planner's progress, shown as `what` once this rank's plan is settled (`start`);
    `finish` ends it (after a load or save that did not fail)."""

    def __init__(self, what: str):
        self.what = what
        self.progress: PhaseProgress | None = None

    def start(self, total: int) -> None:
        self.progress = PhaseProgress(self.what, total, size_text)

    def advance(self, done: int) -> None:
        if self.progress is not None:
            self.progress.advance(done)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.finish()


class SavePlannerShowingProgress(ShowingProgress, DefaultSavePlanner):
    """DCP's default save planner (its keyword arguments), showing the write's progress."""

    def __init__(self, what: str, **kwargs: object):
        ShowingProgress.__init__(self, what)
        DefaultSavePlanner.__init__(self, **kwargs)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        self.start(sum(written_bytes(item) for item in plan.items))
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | object:
        data = super().resolve_data(write_item)
        self.advance(written_bytes(write_item))
        return data


class LoadPlannerShowingProgress(ShowingProgress, DefaultLoadPlanner):
    """DCP's default load planner, showing the read's progress."""

    def __init__(self, what: str):
        ShowingProgress.__init__(self, what)
        DefaultLoadPlanner.__init__(self)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        plan = super().finish_plan(new_plan)
        self.start(
            sum(
                math.prod(item.lengths) * self.lookup_tensor(item.dest_index).element_size()
                for item in plan.items
                if item.type == LoadItemType.TENSOR
            )
        )
        return plan

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self.advance(tensor.nbytes)
