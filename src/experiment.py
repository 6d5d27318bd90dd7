"""One experiment from a composed config: check it, build everything, run the loop, report.

`run(cfg)` is what `train.py` calls inside the Hydra job. Every check that can fail on bad input
runs before any process, model or tracker is created.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src.loop import fit
from src.optim import build_optimizer
from src.strategies import build_strategy
from src.strategies.base import ConfigError, Strategy, resolve_device_type
from src.tracking import build_tracker

log = logging.getLogger(__name__)


def check_config(cfg: DictConfig) -> Strategy:
    """Every check that needs no process or device work; returns the (unstarted) strategy."""
    trainer = cfg.trainer
    for key in ("max_steps", "batch_size", "accumulate", "log_every"):
        if trainer[key] < 1:
            raise ConfigError(f"trainer.{key} must be at least 1, got {trainer[key]}")
    if trainer.batch_size % trainer.accumulate:
        raise ConfigError(
            f"trainer.batch_size={trainer.batch_size} does not divide into "
            f"trainer.accumulate={trainer.accumulate} micro-batches"
        )
    if trainer.precision not in ("fp32", "bf16"):
        raise ConfigError(f"trainer.precision must be fp32 or bf16, got {trainer.precision!r}")
    device_type = resolve_device_type(trainer.accelerator)
    if trainer.precision == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("trainer.precision=bf16 but this GPU has no bf16 support; use fp32")
    strategy = build_strategy(cfg.parallel, device_type)
    strategy.check_batch(trainer.batch_size // trainer.accumulate)
    return strategy


def run(cfg: DictConfig) -> dict[str, Any]:
    strategy = check_config(cfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    log.info("config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
    return train(cfg, run_dir, strategy)


def train(cfg: DictConfig, run_dir: Path, strategy: Strategy) -> dict[str, Any]:
    """Train in this process (one of several, for multi-process strategies)."""
    strategy.setup()
    try:
        if cfg.trainer.deterministic:
            # cuBLAS is only deterministic with a fixed workspace (torch reproducibility notes).
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        data = instantiate(cfg.data, seed=cfg.seed)
        torch.manual_seed(cfg.seed)
        model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
        model = strategy.wrap(model)
        optimizer = build_optimizer(cfg.optimizer, strategy.unwrap(model).parameters())
        resolved = OmegaConf.to_container(cfg, resolve=True)
        tracker = build_tracker(cfg.logger, str(run_dir), resolved, strategy.is_main)
        summary, exit_code = None, 1
        try:
            results = fit(cfg, strategy, model, optimizer, data, tracker, run_dir)
            summary = {
                "strategy": strategy.name,
                "devices": cfg.parallel.devices,
                "world_size": strategy.world_size,
                "global_batch": cfg.trainer.batch_size,
                **results,
                **strategy.report(),
            }
            exit_code = 0
        finally:
            tracker.finish(summary, exit_code)
        if strategy.is_main:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            log.info("\n%s", format_summary(summary, run_dir))
        return summary
    finally:
        strategy.teardown()


def format_summary(summary: dict[str, Any], run_dir: Path) -> str:
    def fmt(value: Any) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return "nan"
            return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
        if isinstance(value, list):
            return ", ".join(fmt(v) for v in value)
        return str(value)

    rows = [(key, fmt(value)) for key, value in summary.items()]
    rows.append(("outputs", str(run_dir)))
    width = max(len(key) for key, _ in rows)
    lines = [f"  {key:<{width}}  {value}" for key, value in rows]
    rule = "-" * max(len(line) for line in lines)
    return "\n".join(["run summary", rule, *lines, rule])
