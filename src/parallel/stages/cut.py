"""What `model_parallel` and `hybrid` compose: a model cut into stages on one process's
devices. `StageCut` checks the pipeline's settings before any work, chooses the split points on
the meta model, builds the `Pipeline` (`pipeline.py`) and gives the planner its `StageCosts`
(`costs.py`). An nn.Sequential is cut between its children; any other model by torch's tracer
at its blocks, as parallel.pp cuts it (`pp.cut.cut_at`). `model_parallel` is a `StageCut`
on the process's `parallel.devices` devices; `hybrid` (`hybrid.py`) is DDP over one on each
process's `parallel.stages` devices.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from torch import nn

from src.components.batches import Tree, meta_resized
from src.components.model_contract import blocks_of
from src.config.parallel import StagesConfig
from src.parallel.base import ConfigError
from src.parallel.pp.cut import META, balanced_split_points, cut_at, parameter_count, place
from src.parallel.shares import Segments
from src.parallel.stages.costs import StageCosts
from src.parallel.stages.deferred_batchnorm import defer_batchnorm
from src.parallel.stages.pipeline import (
    Pipeline,
    describe_value,
    log_layout,
    unmovable_boundaries,
)


class StageCut:
    """`stages` stages (the value of the setting named `stages_setting`) over
    `cfg.microbatches` micro-batches."""

    def __init__(self, cfg: StagesConfig, stages: int, stages_setting: str):
        self.cfg, self.stages, self.stages_setting = cfg, stages, stages_setting
        self.check_split_points(cfg.split_points)
        self.split_points = cfg.split_points  # until `choose_cuts` has looked at the model
        self.segment_points = cfg.split_points  # the same, as the planner's `Segments` count
        self.layout: dict[str, Any] = {}
        self.microbatch_samples = 1  # the largest micro-batch's (`check_samples`)
        self.example: Tree = None  # a micro-batch of inputs (meta), traced by `choose_cuts`

    def check_samples(self, samples: int, batch: str) -> None:
        """ConfigError when `samples` (what one pipeline gets per micro-step, described by
        `batch`) cannot be cut into the micro-batches."""
        if samples < self.cfg.microbatches:
            raise ConfigError(
                f"{batch} is {samples} samples, too few for parallel.microbatches="
                f"{self.cfg.microbatches}; lower parallel.microbatches or raise trainer.batch_size"
            )
        self.microbatch_samples = -(-samples // self.cfg.microbatches)  # tensor_split's first

    def choose_cuts(self, model: nn.Module, inputs: Tree) -> None:
        """Settle the split points on `model` (meta) fed `inputs` (meta). An nn.Sequential is
        cut between its children; any other model before its blocks by torch's tracer
        (`pp.cut.cut_at`, as parallel.pp cuts it), tried here so that a model it cannot
        cut is refused before any work."""
        self.example = meta_resized(inputs, self.microbatch_samples)
        self.split_points = self.settled_points(model, inputs)
        first = Segments(model).first  # block 0's segment: after the rest's first, if any
        self.segment_points = [point + first for point in self.split_points]

    def settled_points(self, model: nn.Module, inputs: Tree) -> list[int]:
        """`choose_cuts`' split points, checked: where they cut an nn.Sequential, or where torch's
        tracer cuts any other model."""
        if isinstance(model, nn.Sequential):
            return self.split_points_for(list(model), unmovable_boundaries(model, inputs))
        if self.cfg.deferred_batchnorm:
            raise ConfigError(
                "parallel.deferred_batchnorm defers the BatchNorms of an nn.Sequential's blocks "
                f"only; {type(model).__name__} is cut by torch's tracer, whose stages cannot "
                "defer them: set parallel.deferred_batchnorm=false"
            )
        points = self.split_points_for(blocks_of(model), {})
        cut_at(model, points, self.example, [META] * self.stages, self.stages_setting)
        return points

    def check_split_points(
        self, split_points: Sequence[int] | None, blocks: int | None = None
    ) -> None:
        """Raise ConfigError for split points that cannot cut `blocks` blocks into the stages.
        `blocks=None` runs only the checks that need no model (before it is built)."""
        stages, setting = self.stages, self.stages_setting
        if blocks is not None and stages > blocks:
            raise ConfigError(
                f"{setting}={stages} stages but the model has only {blocks} blocks; "
                f"lower {setting} or deepen the model (model.depth)"
            )
        if split_points is None:
            return
        points = list(split_points)
        if len(points) != stages - 1:
            raise ConfigError(
                f"parallel.split_points={points} has {len(points)} entries but {setting}="
                f"{stages} stages need {stages - 1} (block indices where stages 1.. start)"
            )
        if any(b <= a for a, b in itertools.pairwise([0, *points])):
            raise ConfigError(
                f"parallel.split_points={points} must be strictly increasing block indices above 0"
            )
        if blocks is not None and points and points[-1] >= blocks:
            raise ConfigError(
                f"parallel.split_points={points} reaches past the model's last block "
                f"(index {blocks - 1}); every stage needs at least one block"
            )

    def split_points_for(self, blocks: list[nn.Module], unmovable: dict[int, Any]) -> list[int]:
        """Where stages 1.. start for a model of `blocks` (built on the meta device), none where
        the block before returns what cannot change devices (`unmovable`: block index: that
        value): `parallel.split_points` when given, else the split balanced by parameter count.
        Raises ConfigError when a stage would start at a block in `unmovable`."""
        split_points = self.cfg.split_points
        self.check_split_points(split_points, blocks=len(blocks))
        if split_points is not None:
            for point in (point for point in split_points if point in unmovable):
                raise ConfigError(
                    f"parallel.split_points={list(split_points)}: block {point - 1} returns "
                    f"{describe_value(unmovable[point])}, which cannot be handed to a stage "
                    f"starting at block {point} (only tensors, and tuples, lists and dicts of "
                    "tensors, move between devices); split elsewhere, or leave "
                    "parallel.split_points unset"
                )
            return list(split_points)
        cuttable = set(range(1, len(blocks))) - unmovable.keys()
        points = balanced_split_points([parameter_count(b) for b in blocks], self.stages, cuttable)
        if points is None:
            blocked = ", ".join(
                f"block {point} (block {point - 1} returns {describe_value(value)})"
                for point, value in sorted(unmovable.items())
            )
            raise ConfigError(
                f"{self.stages_setting}={self.stages} stages need {self.stages - 1} block "
                f"boundaries to cut at, but only {len(cuttable)} of the model's {len(blocks) - 1} "
                f"pass tensors (no stage can start at {blocked}); lower {self.stages_setting}"
            )
        return points

    def pipeline(self, model: nn.Module, devices: list) -> Pipeline:
        """`model` cut into stages on `devices`, its layout logged and kept for `report`."""
        if self.cfg.deferred_batchnorm:
            model = defer_batchnorm(model, self.cfg.microbatches)
        cut = None
        if not isinstance(model, nn.Sequential):  # traced, bound to its tensors, moved here
            cut = cut_at(model, self.split_points, self.example, devices, self.stages_setting)
            place(model, lambda name: devices[cut.stage_of[name]])
        pipeline = Pipeline(model, devices, self.cfg.microbatches, self.split_points, cut)
        self.layout = pipeline.describe()
        log_layout(self.layout)
        return pipeline

    def costs(self, device_type: str, gradient_buckets: bool = False) -> StageCosts:
        """What the cut costs on `device_type` devices (after `choose_cuts`); with
        `gradient_buckets` each stage keeps a second copy of its gradients (DDP's buckets)."""
        assert self.segment_points is not None, "choose_cuts first: the cut has no split points"
        points = tuple(self.segment_points)
        return StageCosts(device_type, self.stages, points, self.cfg.microbatches, gradient_buckets)
