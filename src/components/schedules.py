"""The learning rate at each step: the template's schedules (`constant`, `linear`, `cosine`,
`wsd`), or a learning-rate scheduler class's curve. Either is a function of the step alone, which
the loop sets on every parameter group before each step: a resumed run picks up at its step with
no scheduler state to save, under any strategy."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from src.components.targets import check_arguments, import_target
from src.config.base import ConfigError
from src.config.optimizer import SCHEDULES, OptimizerConfig

# A decay's factor between its start (1) and its end (0), at `progress` in [0, 1].
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda progress: 1 - progress,
    "cosine": lambda progress: 0.5 * (1 + math.cos(math.pi * progress)),
    "1-sqrt": lambda progress: 1 - math.sqrt(progress),
}


def schedule_length(cfg: Mapping[str, Any], max_steps: int) -> int:
    """The steps the schedule decays over: `optimizer.schedule_steps`, or else the run's
    `trainer.max_steps`. `cfg` may be a saved checkpoint's optimizer settings, which older
    checkpoints write without `schedule_steps`."""
    steps = cfg.get("schedule_steps")
    return max_steps if steps is None else steps


def lr_schedule(cfg: OptimizerConfig, max_steps: int) -> Callable[[int], float]:
    """The learning rate at each step (from 0) of `optimizer.schedule`: one of `SCHEDULES`, or a
    scheduler class's curve (`scheduler_curve`)."""
    if cfg.schedule not in SCHEDULES:
        return scheduler_curve(cfg)
    if cfg.get("schedule_steps") is not None and cfg.schedule_steps < 1:
        raise ConfigError(
            f"optimizer.schedule_steps must be at least 1, or null for trainer.max_steps; got "
            f"{cfg.schedule_steps}"
        )
    length = schedule_length(cfg, max_steps)

    # Read once: the loop calls lr_at every step, and a config lookup takes microseconds.
    lr, warmup_steps, floor = cfg.lr, cfg.warmup_steps, cfg.lr * cfg.min_lr_ratio
    decay_start, shape = decay_of(cfg, length)

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        if step < decay_start:
            return lr
        progress = (step - decay_start) / max(1, length - decay_start)
        return floor + (lr - floor) * shape(min(1.0, progress))

    return lr_at


def decay_of(cfg: OptimizerConfig, length: int) -> tuple[float, Callable[[float], float]]:
    """Where the decay of a schedule over `length` steps starts (`inf`: it never does), and its
    shape. Only wsd reads `decay_fraction` and `decay_shape`, which older checkpoints lack."""
    if cfg.schedule == "constant":
        return math.inf, DECAY_SHAPES["linear"]
    if cfg.schedule != "wsd":
        return cfg.warmup_steps, DECAY_SHAPES[str(cfg.schedule)]
    if not 0 < cfg.decay_fraction <= 1:
        raise ConfigError(
            f"optimizer.decay_fraction={cfg.decay_fraction}: the fraction of the steps that wsd's "
            "decay takes must be in (0, 1]"
        )
    decay_steps = round(cfg.decay_fraction * length)
    return max(cfg.warmup_steps, length - decay_steps), DECAY_SHAPES[str(cfg.decay_shape)]


def scheduler_curve(cfg: OptimizerConfig) -> Callable[[int], float]:
    """The learning rate that `optimizer.schedule`'s scheduler class (with `schedule_args`)
    gives at each step, from `optimizer.lr`: stepped on an optimizer of its own, once per
    training step (as far as asked, and kept), so that the rate depends on the step alone."""
    name = cfg.schedule
    if "." not in name:
        raise ConfigError(
            f"optimizer.schedule={name}: choose one of {', '.join(SCHEDULES)}, or a learning-rate "
            "scheduler class by its path (optimizer.schedule=torch.optim.lr_scheduler.StepLR)"
        )
    scheduler_class = import_target(name, "optimizer.schedule")
    lr_scheduler = torch.optim.lr_scheduler
    if not (
        isinstance(scheduler_class, type) and issubclass(scheduler_class, lr_scheduler.LRScheduler)
    ):
        raise ConfigError(
            f"optimizer.schedule={name} is no learning-rate scheduler class (a "
            f"torch.optim.lr_scheduler.LRScheduler); choose one, or {', '.join(SCHEDULES)}"
        )
    if issubclass(scheduler_class, lr_scheduler.ReduceLROnPlateau):
        raise ConfigError(
            f"optimizer.schedule={name} steps on a metric, and the schedule here is a function of "
            "the step; choose a scheduler of the step alone, or one of " + ", ".join(SCHEDULES)
        )
    args = cfg.schedule_args  # a saved run's are plain, and resolved
    if isinstance(args, DictConfig):
        args = OmegaConf.to_container(args, resolve=True)
    check_arguments("optimizer.schedule_args", name, scheduler_class, args)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    try:
        scheduler = scheduler_class(optimizer, **args)
    except TypeError as error:  # an argument it needs is missing
        raise ConfigError(f"optimizer.schedule={name}: {error}") from None
    rates = [optimizer.param_groups[0]["lr"]]

    def lr_at(step: int) -> float:
        while len(rates) <= step:
            optimizer.step()  # no gradient, no change: the order torch's schedulers expect
            scheduler.step()
            rates.append(optimizer.param_groups[0]["lr"])
        return float(rates[step])

    return lr_at
