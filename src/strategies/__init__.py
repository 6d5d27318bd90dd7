"""One module per `parallel=` option; `build_strategy` imports only the one asked for."""

from __future__ import annotations

import importlib

from src.config import ParallelConfig
from src.strategies.base import ConfigError, Strategy

STRATEGIES = {
    "single": "src.strategies.single:Single",
    "dp": "src.strategies.dp:DP",
    "dp_criterion": "src.strategies.dp_criterion:DPCriterion",
    "model_parallel": "src.strategies.model_parallel:ModelParallel",
    "ddp": "src.strategies.ddp:DDP",
    "hybrid": "src.strategies.hybrid:Hybrid",
    "fsdp": "src.strategies.fsdp:FSDP",
}


def build_strategy(cfg: ParallelConfig, device_type: str, precision: str = "fp32") -> Strategy:
    """The strategy named by `cfg.name`, its settings checked; nothing is started yet.
    `precision` is `trainer.precision`, for strategies that keep parameters in it (fsdp)."""
    if cfg.name not in STRATEGIES:
        raise ConfigError(
            f"unknown parallel.name {cfg.name!r}; choose one of {', '.join(STRATEGIES)}"
        )
    module_name, class_name = STRATEGIES[cfg.name].split(":")
    strategy_class = getattr(importlib.import_module(module_name), class_name)
    strategy = strategy_class(cfg, device_type)
    strategy.precision = precision
    return strategy
