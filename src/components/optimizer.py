"""Optimizers and the learning-rate schedule, built from the unwrapped model's parameters."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from hydra.utils import instantiate

from src.config.base import ConfigError
from src.config.optimizer import OWN_KEYS, OptimizerConfig


def build_optimizer(
    cfg: OptimizerConfig, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer that `optimizer._target_` names, over `params` in `parameter_groups`, with
    its settings (all but `OWN_KEYS`)."""
    settings = {key: value for key, value in cfg.items() if key not in OWN_KEYS}
    return instantiate(settings, _convert_="all")(parameter_groups(params, cfg.decay_1d))


def parameter_groups(params: Iterable[torch.nn.Parameter], decay_1d: bool) -> list[dict[str, Any]]:
    """One group of every parameter; without `decay_1d`, the matrices (2 or more dimensions:
    weights, embeddings) and then a group of the rest without weight decay. Each group keeps the
    parameters' order, and a group stays even when this process holds none of its parameters,
    so that every strategy and pipeline rank has single's groups."""
    params = list(params)
    if decay_1d:
        return [{"params": params}]
    return [
        {"params": [param for param in params if param.dim() >= 2]},
        {"params": [param for param in params if param.dim() < 2], "weight_decay": 0.0},
    ]


def adamw(
    params: list[dict[str, Any]], betas: Sequence[float], **settings: Any
) -> torch.optim.AdamW:
    """torch's AdamW over parameter groups, fused on GPUs (`on_cuda`)."""
    every = [param for group in params for param in group["params"]]
    return torch.optim.AdamW(params, betas=tuple(betas), fused=on_cuda(every) or None, **settings)


def on_cuda(params: list[torch.nn.Parameter]) -> bool:
    """Whether every parameter is on a GPU, where one fused kernel per step replaces AdamW's
    per-tensor (foreach) kernels; a CPU or meta model keeps torch's default."""
    return bool(params) and all(param.device.type == "cuda" for param in params)


def schedule_length(cfg: Mapping[str, Any], max_steps: int) -> int:
    """The steps the cosine decays over: `optimizer.schedule_steps`, or else the run's
    `trainer.max_steps`. `cfg` may be a saved checkpoint's optimizer settings, which older
    checkpoints write without `schedule_steps`."""
    steps = cfg.get("schedule_steps")
    return max_steps if steps is None else steps


def lr_schedule(cfg: OptimizerConfig, max_steps: int) -> Callable[[int], float]:
    """The learning rate at each step: linear warm-up, then constant or cosine decay (over
    `schedule_length` steps; later steps keep its final rate)."""
    if cfg.get("schedule_steps") is not None and cfg.schedule_steps < 1:
        raise ConfigError(
            f"optimizer.schedule_steps must be at least 1, or null for trainer.max_steps; got "
            f"{cfg.schedule_steps}"
        )
    decay_steps = schedule_length(cfg, max_steps)

    # Read once: the loop calls lr_at every step, and a config lookup takes microseconds.
    lr, warmup_steps, schedule = cfg.lr, cfg.warmup_steps, cfg.schedule
    floor = lr * cfg.min_lr_ratio

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        if schedule == "constant":
            return lr
        progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
        return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return lr_at
