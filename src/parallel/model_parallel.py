"""`parallel=model_parallel`: the block stack cut into `parallel.devices` stages, one per device,
driven by one process (a `StageCut`). `parallel.microbatches=1` runs the naive schedule (one
stage busy at a time); M > 1 pipelines M micro-batches through the stages in GPipe order
(`mechanisms/stage_pipeline.py`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from src.components.batches import Tree
from src.config.parallel import PipelineConfig
from src.parallel.base import LossFn, Strategy
from src.parallel.shares import DeviceShare, ModelSizes
from src.parallel.stage_cut import StageCut
from src.runtime.ranks import Ranks


class ModelParallel(Strategy):
    settings_schema = PipelineConfig

    def __init__(self, cfg, device_type: str, precision: str = "fp32", ranks: Ranks | None = None):
        super().__init__(cfg, device_type, precision, ranks)
        self.stage_cut = StageCut(cfg, cfg.devices, "parallel.devices")

    def check_batch(self, micro_batch: int) -> None:
        super().check_batch(micro_batch)
        batch = "the batch per micro-step (batch_size / accumulate)"
        self.stage_cut.check_samples(micro_batch, batch)

    def check_model(self, model: nn.Module, inputs: Tree) -> None:
        self.stage_cut.plan(model, inputs)

    def wrap(self, model: nn.Module) -> nn.Module:
        return self.stage_cut.pipeline(model, self.devices)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.model

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        return model(inputs, targets, fn)  # the loss on the last stage, where the outputs are

    def report(self) -> dict[str, Any]:
        return self.stage_cut.layout

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        return self.stage_cut.device_shares(self.device_type, sizes, micro_batch, False)

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        return self.stage_cut.step_traffic(sizes, micro_batch, accumulate)

    def idle_fraction(self) -> float:
        return self.stage_cut.idle_fraction()
