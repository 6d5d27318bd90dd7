"""`parallel=model_parallel`: the block stack cut into `parallel.devices` stages, one per device,
driven by one process. `parallel.microbatches=1` runs the naive schedule (one stage busy at a
time); M > 1 pipelines M micro-batches through the stages in GPipe order (`pipeline.py`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from src.strategies.base import DeviceShare, LossFn, ModelSizes, Strategy
from src.strategies.pipeline import (
    Pipeline,
    boundary_bytes,
    bubble_fraction,
    check_microbatches,
    check_split_points,
    check_tied_parameters,
    log_layout,
    plan_split_points,
    stage_shares,
)


class ModelParallel(Strategy):
    def __init__(self, cfg, device_type: str):
        super().__init__(cfg, device_type)
        check_microbatches(cfg.microbatches)
        check_split_points(cfg.split_points, cfg.devices, "parallel.devices")
        self.split_points = cfg.split_points  # until check_model has looked at the model
        self.layout: dict[str, Any] = {}

    def check_batch(self, micro_batch: int) -> None:
        super().check_batch(micro_batch)
        check_microbatches(
            self.cfg.microbatches, micro_batch, "the batch per micro-step (batch_size / accumulate)"
        )

    def check_model(self, model: nn.Module, inputs: torch.Tensor) -> None:
        self.split_points = plan_split_points(
            model, inputs, self.cfg.devices, self.cfg.split_points, "parallel.devices"
        )
        check_tied_parameters(model, self.split_points, self.device_type)

    def wrap(self, model: nn.Module) -> nn.Module:
        pipeline = Pipeline(model, self.devices, self.cfg.microbatches, self.split_points)
        self.layout = pipeline.describe()
        log_layout(self.layout)
        return pipeline

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.model

    def apply(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, fn: LossFn
    ) -> torch.Tensor:
        return model(inputs, targets, fn)

    def report(self) -> dict[str, Any]:
        return self.layout

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        return stage_shares(
            self.device_type, self.split_points, sizes, micro_batch, self.cfg.microbatches, False
        )

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        return {
            "stage activations": accumulate * boundary_bytes(self.split_points, sizes, micro_batch)
        }

    def idle_fraction(self) -> float:
        return bubble_fraction(self.cfg.devices, self.cfg.microbatches)
