"""Experiment tracking: a W&B run on the main process, or nothing.

`wandb` is imported only when a W&B run is asked for, so `logger=none` starts fast. A tracker
never stops training: if W&B cannot start or fails later, one warning is logged and the run goes
on without it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from src.config import ConfigError

log = logging.getLogger(__name__)

WANDB_MODES = ("offline", "online", "shared", "disabled")


def check_tracker(cfg: Any) -> None:
    """Settings that W&B would only reject once training starts (where it must not fail)."""
    if cfg.name not in ("none", "wandb"):
        raise ConfigError(f"unknown logger.name {cfg.name!r}; use logger=wandb or logger=none")
    if cfg.name == "wandb" and cfg.mode not in WANDB_MODES:
        raise ConfigError(f"logger.mode must be one of {', '.join(WANDB_MODES)}, got {cfg.mode!r}")


class NullTracker:
    run_id: str | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        pass


class WandbTracker:
    """A W&B run whose files live in `<run_dir>/wandb`."""

    def __init__(self, cfg: Any, run_dir: str, config: dict[str, Any], resume_id: str | None):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group,
            name=cfg.run_name,
            tags=list(cfg.tags),
            job_type=cfg.job_type,
            config=config,
            dir=run_dir,
            mode=os.environ.get("WANDB_MODE", cfg.mode),
            id=resume_id,
            resume="allow" if resume_id else None,
            settings=wandb.Settings(init_timeout=cfg.init_timeout_s),
        )
        self.run_id = self.run.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log(metrics, step=step)
        except Exception as error:  # noqa: BLE001 - tracking must never stop training
            log.warning("W&B logging failed, continuing without it: %s", error)
            self.run = None

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        if self.run is None:
            return
        try:
            if summary:
                self.run.summary.update(summary)
            self.run.finish(exit_code=exit_code)
        except Exception as error:  # noqa: BLE001
            log.warning("W&B could not finish the run: %s", error)


def build_tracker(
    cfg: Any, run_dir: str, config: dict[str, Any], is_main: bool, resume_id: str | None = None
) -> WandbTracker | NullTracker:
    if not is_main or cfg.name == "none":
        return NullTracker()
    try:
        return WandbTracker(cfg, run_dir, config, resume_id)
    except Exception as error:  # noqa: BLE001 - no network or a bad key must not stop training
        log.warning("W&B could not start (%s); training continues without tracking", error)
        return NullTracker()
