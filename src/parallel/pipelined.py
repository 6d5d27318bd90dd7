"""What `model_parallel` and `hybrid` share: a pipeline's settings checked before any work, the
split points planned on the meta model, and the model run as a `Pipeline` (`pipeline.py`).

The two differ in the setting that gives the stages per pipeline (`stages_setting`), in how many
pipelines share the batch (`world_size`) and in what they wrap around the pipeline.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from src.components.batches import Tree
from src.parallel.base import ConfigError, DeviceShare, LossFn, ModelSizes, Strategy
from src.parallel.mechanisms.deferred_batchnorm import defer_batchnorm
from src.parallel.mechanisms.stage_pipeline import (
    Pipeline,
    balanced_split_points,
    boundary_bytes,
    bubble_fraction,
    check_tied_parameters,
    describe_value,
    log_layout,
    parameter_count,
    stage_shares,
    unmovable_boundaries,
)
from src.runtime.ranks import Ranks


class Pipelined(Strategy):
    stages_setting = "parallel.devices"  # the setting that gives the stages per pipeline

    def __init__(
        self, cfg, device_type: str, precision: str = "fp32", ranks: Ranks | None = None
    ):
        super().__init__(cfg, device_type, precision, ranks)
        if cfg.microbatches < 1:
            raise ConfigError(f"parallel.microbatches must be at least 1, got {cfg.microbatches}")
        if cfg.deferred_batchnorm and getattr(cfg, "sync_batchnorm", False):
            raise ConfigError(
                "parallel.deferred_batchnorm=true and parallel.sync_batchnorm=true both replace "
                "BatchNorm; choose one"
            )
        self.check_split_points(cfg.split_points)
        self.split_points = cfg.split_points  # until check_model has looked at the model
        self.layout: dict[str, Any] = {}

    @property
    def stages(self) -> int:
        """Stages per pipeline: the value of `stages_setting`."""
        return getattr(self.cfg, self.stages_setting.removeprefix("parallel."))

    def check_batch(self, micro_batch: int) -> None:
        super().check_batch(micro_batch)
        samples, microbatches = micro_batch // self.world_size, self.cfg.microbatches
        if samples < microbatches:
            batch = (
                "the batch per micro-step (batch_size / accumulate)"
                if self.world_size == 1
                else "the batch per process and micro-step (batch_size / accumulate / processes)"
            )
            raise ConfigError(
                f"{batch} is {samples} samples, too few for parallel.microbatches={microbatches}; "
                "lower parallel.microbatches or raise trainer.batch_size"
            )

    def check_model(self, model: nn.Module, inputs: Tree) -> None:
        self.split_points = self.plan_split_points(model, inputs)
        check_tied_parameters(model, self.split_points, self.device_type)

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

    def plan_split_points(self, model: nn.Sequential, inputs: Tree) -> list[int]:
        """Where stages 1.. start for `model` (built on the meta device) fed `inputs` (meta):
        `parallel.split_points` when given, else the split balanced by parameter count. Raises
        ConfigError when a stage would start at a block whose input cannot change devices."""
        split_points = self.cfg.split_points
        self.check_split_points(split_points, blocks=len(model))
        unmovable = unmovable_boundaries(model, inputs)
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
        cuttable = set(range(1, len(model))) - unmovable.keys()
        points = balanced_split_points([parameter_count(b) for b in model], self.stages, cuttable)
        if points is None:
            blocked = ", ".join(
                f"block {point} (block {point - 1} returns {describe_value(value)})"
                for point, value in sorted(unmovable.items())
            )
            raise ConfigError(
                f"{self.stages_setting}={self.stages} stages need {self.stages - 1} block "
                f"boundaries to cut at, but only {len(cuttable)} of the model's {len(model) - 1} "
                f"pass tensors (no stage can start at {blocked}); lower {self.stages_setting}"
            )
        return points

    def pipeline(self, model: nn.Module) -> Pipeline:
        """`model` cut into this process's stages, its layout logged and kept for `report`."""
        if self.cfg.deferred_batchnorm:
            model = defer_batchnorm(model, self.cfg.microbatches)
        pipeline = Pipeline(model, self.devices, self.cfg.microbatches, self.split_points)
        self.layout = pipeline.describe()
        log_layout(self.layout)
        return pipeline

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        return model(inputs, targets, fn)

    def report(self) -> dict[str, Any]:
        return self.layout

    def gradient_buckets(self) -> bool:
        """Whether each stage keeps a second copy of its gradients (DDP's buckets)."""
        return False

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        """The first pipeline's stages, on its share of the batch."""
        samples = micro_batch // self.world_size
        return stage_shares(
            self.device_type,
            self.split_points,
            sizes,
            samples,
            self.cfg.microbatches,
            self.gradient_buckets(),
        )

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        samples = micro_batch // self.world_size
        return {"stage activations": accumulate * boundary_bytes(self.split_points, sizes, samples)}

    def idle_fraction(self) -> float:
        return bubble_fraction(self.stages, self.cfg.microbatches)
