"""`parallel=model_parallel`: the block stack cut into `parallel.devices` stages, one per device,
driven by one process (a `StageCut`). `parallel.microbatches=1` runs the naive schedule (one
stage busy at a time); M > 1 pipelines M micro-batches through the stages in GPipe order
(`stages/pipeline.py`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from src.components.batches import Tree
from src.config.parallel import PipelineConfig
from src.parallel.base import LossFn, Strategy
from src.parallel.stages.costs import StageCosts
from src.parallel.stages.cut import StageCut
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
        self.stage_cut.choose_cuts(model, inputs)

    def wrap(self, model: nn.Module) -> nn.Module:
        return self.stage_cut.pipeline(model, self.devices)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.model

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        return model(inputs, targets, fn)  # the loss on the last stage, where the outputs are

    def report(self) -> dict[str, Any]:
        return self.stage_cut.layout

    def cost_model(self) -> StageCosts:
        return self.stage_cut.costs(self.device_type)
