"""`parallel=model_parallel`: the block stack cut into `parallel.devices` stages, one per device,
driven by one process. `parallel.microbatches=1` runs the naive schedule (one stage busy at a
time); M > 1 pipelines M micro-batches through the stages in GPipe order (`pipeline.py`)."""

from __future__ import annotations

from torch import nn

from src.parallel.pipelined import Pipelined


class ModelParallel(Pipelined):
    def wrap(self, model: nn.Module) -> nn.Module:
        return self.pipeline(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.model
