"""Schemas of `conf/logger/`: where the run's metrics go besides its own files."""

from __future__ import annotations

from dataclasses import dataclass, field

from src.config.base import choices

WandbMode = choices("WandbMode", "offline online shared disabled", __name__)


@dataclass
class LoggerConfig:
    name: str = "none"


@dataclass
class WandbConfig(LoggerConfig):
    name: str = "wandb"
    project: str = "parallel-training"
    entity: str | None = None
    group: str | None = None
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    job_type: str | None = None
    mode: WandbMode = WandbMode.offline
    """offline (needs no account or network; `wandb sync <run dir>/wandb/offline-run-*` uploads
    it later), online, shared or disabled; the WANDB_MODE environment variable wins when set."""
    init_timeout_s: float = 60.0
    """How long an online run may take to start before the run logs offline instead."""
    log_checkpoints: bool = False
    """Log the best checkpoint (`checkpoints/best/`, trainer.monitor's) as the run's model
    artifact at the end of training."""
