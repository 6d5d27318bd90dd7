"""The weight average's arithmetic, as the state of an optimizer of its own (`AveragedWeights`):
what `src/training/ema.py` keeps in a run, and what the planner traces (a leaf of components, so
that both can import it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

EMA_KEY = "ema"  # the average's entry in the optimizer state, and in checkpoints


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor` (a DTensor's local shard), which in-place ops change."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class AveragedWeights(torch.optim.Optimizer):
    """The average of `parameters` (one group, in the model's order, so that a full checkpoint
    numbers them as the model lists its parameters), as the optimizer state `ema` of each:
    `step()` folds the weights in, the first step copying them (`AveragedModel`'s rule)."""

    def __init__(self, parameters: list[nn.Parameter], decay: float):
        super().__init__(parameters, {})
        self.decay = decay

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """`closure` is the optimizer interface's; DCP's state initialisation passes None."""
        parameters = self.param_groups[0]["params"]
        for parameter in parameters:
            if EMA_KEY not in self.state[parameter]:
                self.state[parameter][EMA_KEY] = parameter.detach().clone()
        averages = [local(self.state[parameter][EMA_KEY]) for parameter in parameters]
        torch._foreach_lerp_(averages, [local(p.detach()) for p in parameters], 1 - self.decay)

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the weights and the averages, in place (a second swap undoes it): one
        parameter's copy at a time, so that the model's layout and wrappers stay as they are."""
        for parameter in self.param_groups[0]["params"]:
            weights, average = local(parameter.detach()), local(self.state[parameter][EMA_KEY])
            held = weights.clone()
            weights.copy_(average)
            average.copy_(held)
