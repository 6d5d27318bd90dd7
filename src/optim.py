"""Optimizers and the learning-rate schedule, built from the unwrapped model's parameters."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from src.config import ConfigError, OptimizerConfig


def build_optimizer(
    cfg: OptimizerConfig, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    params = list(params)
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
            params,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=on_cuda(params) or None,
        )
    raise ConfigError(f"unknown optimizer.name {cfg.name!r}; choose sgd or adamw")


def on_cuda(params: list[torch.nn.Parameter]) -> bool:
    """Whether every parameter is on a GPU, where one fused kernel per step replaces AdamW's
    per-tensor (foreach) kernels; a CPU or meta model keeps torch's default."""
    return bool(params) and all(param.device.type == "cuda" for param in params)


def lr_schedule(cfg: OptimizerConfig, max_steps: int) -> Callable[[int], float]:
    """The learning rate at each step: linear warm-up, then constant or cosine decay."""
    if cfg.schedule not in ("constant", "cosine"):
        raise ConfigError(f"optimizer.schedule must be constant or cosine, got {cfg.schedule!r}")

    # Read once: the loop calls lr_at every step, and a config lookup takes microseconds.
    lr, warmup_steps, schedule = cfg.lr, cfg.warmup_steps, cfg.schedule
    floor = lr * cfg.min_lr_ratio

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        if schedule == "constant":
            return lr
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return lr_at
