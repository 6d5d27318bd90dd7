"""`trainer.monitor`'s best value, the best checkpoint and early stopping (`Monitoring`)."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch

from src.checkpoint.writer import CheckpointWriter
from src.config.base import ConfigError
from src.config.trainer import TrainerConfig
from src.parallel.base import TrainingStrategy
from src.training.loop import Throughput


class Monitoring:
    """`trainer.monitor`'s best value: at each step where the metric is logged (for val/*, the
    evaluation steps) and improves on the best so far, the best checkpoint
    (`checkpoints/best/`); with `trainer.early_stop_patience` N, the stop after N values in a
    row without improvement, and the best weights kept in memory (a copy of this process's
    share of the model, as `evaluated` puts it there: the weight average under
    trainer.ema_eval) for the test pass to score. Every process sees the same all-reduced value,
    so all of them write, count and stop alike."""

    def __init__(
        self,
        trainer: TrainerConfig,
        strategy: TrainingStrategy,
        writer: CheckpointWriter,
        speed: Throughput,
        evaluated: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.metric, self.patience = trainer.monitor, trainer.early_stop_patience
        self.better = operator.lt if trainer.monitor_mode == "min" else operator.gt
        self.strategy, self.writer, self.speed = strategy, writer, speed
        self.evaluated = evaluated
        self.saves = trainer.checkpoint  # trainer.checkpoint=false: the best is only tracked
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.since_best = 0  # values logged since the best
        self.best_weights: dict[str, torch.Tensor] | None = None  # with early stopping only

    def observe(
        self,
        step: int,
        logged: dict[str, float],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: Callable[[], dict[str, Any]],
    ) -> bool:
        """Take the metrics `logged` at `step`; whether the patience has run out."""
        if self.metric is None or not logged_with(self.metric, logged):
            return False
        if self.metric not in logged:  # a model that could not run on the meta device escapes
            raise ConfigError(  # the check before training (`checks.check_monitor`)
                f"trainer.monitor={self.metric} is not logged; this run logs {', '.join(logged)}"
            )
        value = logged[self.metric]
        if self.best_value is None or self.better(value, self.best_value):
            self.best_value, self.best_step, self.since_best = value, step, 0
            with self.speed.paused():
                if self.saves:
                    self.writer.save(model, optimizer, train_state(), best=True)
                if self.patience:
                    with self.evaluated():
                        self.best_weights = weights_copy(self.strategy.unwrap(model))
            return False
        self.since_best += 1
        return 0 < self.patience <= self.since_best

    def restore_best(self, model: torch.nn.Module) -> None:
        """Put the best weights back into `model` (early stopping kept them), where
        `evaluated` puts the weights that evaluation scores."""
        with self.evaluated():
            self.strategy.unwrap(model).load_state_dict(self.best_weights)

    def stop_reason(self) -> str:
        return (
            f"stopping early: {self.metric} has not improved on its best, {self.best_value:.4g} "
            f"at step {self.best_step}, for {self.since_best} values "
            f"(trainer.early_stop_patience={self.patience})"
        )

    def summary(self) -> dict[str, Any]:
        if self.metric is None:
            return {}
        return {"monitor": self.metric, "best_step": self.best_step, "best_value": self.best_value}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it, so that a resumed run goes on from the same best."""
        return {
            "best_value": self.best_value,
            "best_step": self.best_step,
            "since_best": self.since_best,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value, self.best_step = state["best_value"], state["best_step"]
        self.since_best = state["since_best"]


def logged_with(metric: str, logged: dict[str, float]) -> bool:
    """Whether `logged` holds the metrics of `metric`'s kind (`val/...`: an evaluation's)."""
    kind = metric.split("/", 1)[0]
    return any(name.startswith(f"{kind}/") for name in logged)


def weights_copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of `module`'s state_dict (this process's shards, for sharded models), where the
    module holds it, that `load_state_dict` puts back."""
    return {name: value.detach().clone() for name, value in module.state_dict().items()}
