"""A job's config, typed once where the job starts (`job_config`) and handed down as one object.

The groups the code reads as settings are their schemas' objects, their ranges checked as they
are made (a ConfigError, before any work); `parallel` is typed by the strategy it names, built
once per job (`src.parallel.build_strategy`), which keeps its settings. The composed config stays
whole beside them: model, data, task, optimizer and logger are Hydra's to instantiate, with any
keys a user's own class takes, and checkpoints, W&B and the started ranks keep it resolved
(`plain_config`)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from src.config.base import check_given, typed
from src.config.plan import PlanConfig
from src.config.trainer import TrainerConfig


@dataclass(frozen=True)
class JobConfig:
    cfg: DictConfig
    """The composed config, whole: the untyped groups, and eval.py's and sample.py's own keys."""
    trainer: TrainerConfig
    plan: PlanConfig


def job_config(cfg: DictConfig | JobConfig) -> JobConfig:
    """`cfg` (a composed config) typed: ConfigError, in one line, for a setting left without a
    value or out of its range. A `JobConfig` is handed back as it is: the public ways in (the
    tests', the scripts') take either."""
    if isinstance(cfg, JobConfig):
        return cfg
    check_given(cfg)
    return JobConfig(cfg, typed(TrainerConfig, cfg.trainer), typed(PlanConfig, cfg.plan))
