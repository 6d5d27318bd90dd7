"""What the in-process stage cut costs (`StageCosts`, `model_parallel`'s `CostModel`, and
`hybrid`'s replicas' shares): each stage's blocks on its device over the micro-batches, the
activations and their gradients crossing the stage boundaries, GPipe's bubble."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from src.parallel.pp.costs import boundary_bytes, schedule_bubble
from src.parallel.shares import DeviceShare, Messages, ModelSizes


def stage_shares(
    device_type: str,
    split_points: Sequence[int],
    sizes: ModelSizes,
    samples: int,
    microbatches: int,
    gradient_buckets: bool,
) -> list[DeviceShare]:
    """One share per stage on GPUs; on CPU one for the process holding all of them. With
    `gradient_buckets` (DDP over pipelines), a second copy of each stage's gradients."""
    bounds = [0, *split_points, len(sizes.block_parameter_bytes)]
    stages = list(itertools.pairwise(bounds)) if device_type == "cuda" else [(0, bounds[-1])]
    return [
        DeviceShare(
            f"{device_type}:{index}",
            samples,
            blocks=(start, end),
            parts=min(microbatches, samples),
            extra_bytes={"gradients": sizes.blocks_bytes(start, end) if gradient_buckets else 0},
            devices=1 if device_type == "cuda" else len(split_points) + 1,
        )
        for index, (start, end) in enumerate(stages)
    ]


@dataclass(frozen=True)
class StageCosts:
    """`stages` stages on one process's `device_type` devices, split before the segments
    `segment_points` (the planner's `Segments`), over `microbatches` micro-batches; with
    `gradient_buckets` each keeps a second copy of its gradients (DDP's buckets)."""

    device_type: str
    stages: int
    segment_points: tuple[int, ...]
    microbatches: int
    gradient_buckets: bool = False

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        """The stages of a pipeline fed `micro_batch` samples per micro-step."""
        return stage_shares(
            self.device_type,
            self.segment_points,
            sizes,
            micro_batch,
            self.microbatches,
            self.gradient_buckets,
        )

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        traffic = boundary_bytes(self.segment_points, sizes, micro_batch)
        return {"stage activations": accumulate * traffic}

    def idle_fraction(self) -> float:
        return schedule_bubble(self.stages, 1, self.microbatches)  # GPipe's

    def step_messages(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> list[Messages]:
        """None: the stages share one process, their traffic a copy (`step_traffic`)."""
        return []
