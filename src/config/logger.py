"""Schemas of `conf/logger/`: where the run's figures go besides its own files.

Each logger has its section (`logger.mlflow`, ...), which each option of `conf/logger/` turns on
(`enabled`); several options merge (`logger=[wandb,tensorboard]`, or `logger=many`). The keys
outside the sections name the run for all of them."""

from __future__ import annotations

from dataclasses import dataclass, field

from src.config.base import choices

WandbMode = choices("WandbMode", "offline online shared disabled", __name__)


@dataclass
class WandbConfig:
    enabled: bool = False
    entity: str | None = None
    mode: WandbMode = WandbMode.offline
    """offline (needs no account or network; `wandb sync <run dir>/wandb/offline-run-*` uploads
    it later), online, shared or disabled; the WANDB_MODE environment variable wins when set."""
    init_timeout_s: float = 60.0
    """How long an online run may take to start before the run logs offline instead."""
    log_checkpoints: bool = False
    """Log the best checkpoint (`checkpoints/best/`, trainer.monitor's) as the run's model
    artifact at the end of training."""


@dataclass
class TensorBoardConfig:
    enabled: bool = False
    log_dir: str | None = None
    """The event files' folder; None: `<run dir>/tensorboard`."""


@dataclass
class MlflowConfig:
    enabled: bool = False
    tracking_uri: str | None = None
    """An MLflow tracking server or store; None: a file store in `<run dir>/mlruns`."""


@dataclass
class CsvConfig:
    """`metrics.csv` (a column per figure, a row per step logged) and `hparams.yaml` (the
    resolved config) in the run folder."""

    enabled: bool = False


@dataclass
class LoggerConfig:
    project: str = "parallel-training"
    """W&B's project; MLflow's experiment."""
    group: str | None = None
    """Runs that belong together; None: the folder they share (a sweep's, or the run's own,
    which `eval.py`'s runs of it join)."""
    run_name: str | None = "${parallel.name}-${parallel.devices}"
    tags: list[str] = field(default_factory=list)
    job_type: str | None = "${parallel.name}"
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    csv: CsvConfig = field(default_factory=CsvConfig)
