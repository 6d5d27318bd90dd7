"""`trainer.ema_decay`: an exponential moving average of the weights (`EMA`), and
`trainer.ema_eval`: evaluation scores it.

The average is kept as the state of an optimizer of its own (`AveragedWeights`): one tensor per
parameter, in the parameter's layout (a shard under fsdp, a DTensor under tp, a stage's under pp).
Every strategy already saves, reshards and restores an optimizer's state, full or sharded, for
any layout to resume: the average goes through the same code, so it needs none of its own. The
update is the same arithmetic on each rank's own part of each parameter, which is why any layout
averages single's weights.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from src.components.averaged_weights import EMA_KEY, AveragedWeights
from src.config.trainer import TrainerConfig
from src.parallel.base import TrainingStrategy

log = logging.getLogger(__name__)


def holds_average(checkpoint: dict[str, Any]) -> bool:
    """Whether a checkpoint's run kept a weight average (its config's trainer.ema_decay)."""
    config = checkpoint.get("config") or {}
    return config.get("trainer", {}).get("ema_decay") is not None


class EMA:
    """What the run does with `trainer.ema_decay` and `ema_eval`, off or on alike for the loop:
    `update` after each optimizer step, `evaluated` around what scores the weights, `saved` for
    the checkpoints, `load` on resume."""

    def __init__(self, trainer: TrainerConfig, parameters: list[nn.Parameter]):
        self.averaged = None
        if trainer.ema_decay is not None:
            self.averaged = AveragedWeights(parameters, trainer.ema_decay)
        self.scored = trainer.ema_eval

    def update(self) -> None:
        if self.averaged is not None:
            self.averaged.step()

    @contextlib.contextmanager
    def evaluated(self) -> Iterator[None]:
        """The weights evaluation scores in the model inside: the average under ema_eval (the
        weights are swapped back after), else the weights themselves."""
        if not self.scored:
            yield
            return
        self.averaged.swap()
        try:
            yield
        finally:
            self.averaged.swap()

    def saved(self) -> dict[str, torch.optim.Optimizer]:
        """What a checkpoint holds of it, by its key there (see `CheckpointWriter`)."""
        return {} if self.averaged is None else {EMA_KEY: self.averaged}

    def load(
        self,
        strategy: TrainingStrategy,
        model: nn.Module,
        state: dict[str, Any],
        checkpoint: Path,
        in_shards: bool,
    ) -> None:
        """The average of the checkpoint `state` was read from (in `state` when read whole,
        else read here in this rank's shards), when it holds one: a run that kept none starts
        its average at the next step."""
        if self.averaged is None:
            return
        if not holds_average(state):
            if strategy.is_main:
                log.info("%s holds no weight average: it starts at the next step", checkpoint)
            return
        if in_shards:
            strategy.load_sharded(model, self.averaged, str(checkpoint), key=EMA_KEY)
        else:
            strategy.load_optimizer_state_dict(model, self.averaged, state[EMA_KEY])
