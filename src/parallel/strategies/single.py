"""`parallel=single`: the whole model on one device; the reference every strategy must match."""

from __future__ import annotations

import torch
from torch import nn

from src.components.batches import Tree, move
from src.parallel.base import ConfigError, LossFn, Strategy
from src.parallel.shares import OneDevice
from src.runtime.ranks import Ranks


class Single(Strategy):
    sharded_checkpoints = True

    def __init__(self, cfg, device_type: str, precision: str = "fp32", ranks: Ranks | None = None):
        super().__init__(cfg, device_type, precision, ranks)
        if cfg.devices != 1:
            raise ConfigError(
                f"parallel=single uses one device, got parallel.devices={cfg.devices}; "
                "pick a parallel strategy (dp, ddp, ...) for more"
            )

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.devices[0])

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        device = self.devices[0]
        return fn(model(move(inputs, device)), move(targets, device))

    def cost_model(self) -> OneDevice:
        return OneDevice(self.device_type)
