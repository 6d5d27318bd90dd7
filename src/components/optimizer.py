"""Optimizers and the learning-rate schedule, built from the unwrapped model's parameters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from src.components.targets import check_arguments, import_target, settle_settings
from src.config.optimizer import OWN_KEYS, OptimizerConfig

# Settings of `optimizer` that are the template's, not the optimizer class's.
TEMPLATE_KEYS = ("_target_", "_partial_", *OWN_KEYS)


def build_optimizer(
    cfg: OptimizerConfig, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer that `optimizer._target_` names, over `params` in `parameter_groups`, with
    its settings (all but `OWN_KEYS`); a ConfigError if it does not import or does not take
    them."""
    target = import_target(cfg._target_, "optimizer._target_")
    settings = {key: value for key, value in cfg.items() if key not in OWN_KEYS}
    given = [key for key in settings if key not in TEMPLATE_KEYS]
    check_arguments("optimizer", cfg._target_, target, given)
    return instantiate(settings, _convert_="all")(parameter_groups(params, cfg.decay_1d))


def settle_optimizer_settings(cfg: DictConfig) -> None:
    """`optimizer._target_` set to another class than its option's: the option's own settings
    that the new class does not take are left out (`settle_settings`)."""
    settle_settings(cfg, "optimizer", TEMPLATE_KEYS)


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
