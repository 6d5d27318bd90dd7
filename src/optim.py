"""Optimizers and the learning-rate schedule, built from the unwrapped model's parameters."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from src.config import ConfigError, OptimizerConfig


def build_optimizer(
    cfg: OptimizerConfig, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    raise ConfigError(f"unknown optimizer.name {cfg.name!r}; choose sgd or adamw")


def lr_schedule(cfg: OptimizerConfig, max_steps: int) -> Callable[[int], float]:
    """The learning rate at each step: linear warm-up, then constant or cosine decay."""
    if cfg.schedule not in ("constant", "cosine"):
        raise ConfigError(f"optimizer.schedule must be constant or cosine, got {cfg.schedule!r}")

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return cfg.lr
        progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
        floor = cfg.lr * cfg.min_lr_ratio
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return lr_at
