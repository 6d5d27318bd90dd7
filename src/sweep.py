"""What a job of a multirun (`python train.py -m ...`) does beyond a single run.

Hydra runs every job of a sweep even when one raises, but then raises the first error instead of
finishing the multirun, so the end-of-sweep report (`src/report.py`) would never run. A sweep job
therefore records its outcome in `status.json` in its job directory and returns instead of
raising; the report reads those files and makes the sweep exit non-zero when a job failed.

    ok        trained; summary.json is there
    skipped   the combination cannot run (a ConfigError: `hybrid` on one device, more devices than
              GPUs, ...); nothing was started
    failed    the job raised while running; the traceback is in its train.log

A job of a sweep also joins the sweep's W&B group unless `logger.group` is set.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from src.config import ConfigError
from src.stopping import Interrupted
from src.tracking import sweep_group

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"


def run_job(run: Callable[[DictConfig], dict[str, Any]], cfg: DictConfig) -> float:
    """`run(cfg)` as a Hydra job; returns the final validation loss (NaN if it did not train)."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return run(cfg)["final_val_loss"]

    if "group" in cfg.logger:
        cfg.logger.group = sweep_group(cfg.logger, hydra_cfg.sweep.dir)
    job_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        summary = run(cfg)
    except ConfigError as error:
        log.warning("skipped: this combination cannot run: %s", error)
        write_status(job_dir, "skipped", str(error))
    except Interrupted:
        raise  # SIGINT/SIGTERM stop the whole sweep, not just this job
    except Exception as error:  # noqa: BLE001 - recorded, and the sweep goes on with the next job
        log.exception("job %s failed", hydra_cfg.job.num)
        write_status(job_dir, "failed", f"{type(error).__name__}: {error}")
    else:
        write_status(job_dir, "ok")
        return summary["final_val_loss"]
    finally:
        release_device_memory()
    return math.nan


def release_device_memory() -> None:
    """Hand the GPU memory that this job's tensors left cached back to the driver: the next job
    of the sweep runs in this process, maybe on other GPUs, and its peak counts from zero."""
    gc.collect()  # a failed job's traceback can hold its model and optimizer
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def write_status(job_dir: Path, status: str, reason: str = "") -> None:
    if os.environ.get("RANK", "0") != "0":
        return  # one of several ranks that srun started, each in this job: rank 0 speaks for it
    job_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"status": status, "reason": reason}, indent=2) + "\n"
    (job_dir / STATUS_FILE).write_text(text)
