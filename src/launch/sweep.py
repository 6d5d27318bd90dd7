"""What a job of a multirun (`python train.py -m ...`) does beyond a single run.

Hydra runs every job of a sweep even when one raises, but then raises the first error instead of
finishing the multirun, so the end-of-sweep report (`src/observe/report.py`) would never run. A
sweep job therefore records its outcome in `status.json` in its job directory and returns instead of
raising; the report reads those files and makes the sweep exit non-zero when a job failed.

    ok        trained; summary.json is there
    skipped   the combination cannot run (a ConfigError: `hybrid` on one device, more devices than
              GPUs, ...); nothing was started
    failed    the job raised while running; the traceback is in its train.log

A job of a sweep also joins the sweep's group (W&B's, MLflow's tag) unless `logger.group` is set.

A sweep resumes: the same `-m` command with `hydra.sweep.dir=<that sweep>` runs again only what
did not finish. A job whose status.json says ok is not run again (its summary stands); any other
job continues from its own folder's last checkpoint (an interrupted job, a failed one, a SLURM job
requeued after its time limit or a pre-emption) or starts over if it wrote none, unless
`trainer.resume` says otherwise; the report is rebuilt from all of them. Each rank that srun
started decides alone, from files that stay as they are until training writes, so the ranks agree.
A failed job resumes rather than restarts because exact resume makes both train the same weights,
and a transient failure then costs only the steps since the checkpoint. Before any job starts,
`report.check_sweep_dir` refuses a sweep folder that holds another command's jobs.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from src.checkpoint.store import saved_checkpoints
from src.config.base import ConfigError
from src.launch.as_rank import started_ranks
from src.observe.tracking import tracking_group
from src.runtime.ranks import Ranks
from src.runtime.run_folder import status_file, summary_file
from src.runtime.stopping import Interrupted

log = logging.getLogger(__name__)


Task = Callable[[DictConfig, Ranks | None], dict[str, Any]]


def run_job(task: Task) -> Callable[[DictConfig], float]:
    """`task(cfg, ranks)` as a Hydra job, with the ranks that torchrun or srun started read from
    the environment once; the job returns the final validation loss (NaN if it did not train).

    In a multirun, the job records how it ended and returns, and the sweep goes on; a signal
    still stops the sweep."""

    @functools.wraps(task)
    def job(cfg: DictConfig) -> float:
        ranks = started_ranks()
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            return task(cfg, ranks)["final_val_loss"]
        if "group" in cfg.logger:
            cfg.logger.group = tracking_group(cfg.logger, hydra_cfg.sweep.dir)
        status = JobStatus(Path(hydra_cfg.runtime.output_dir), ranks)
        earlier = status.finished_summary()
        if earlier is not None:
            log.info("job %s finished in an earlier run of this sweep: kept", hydra_cfg.job.num)
            loss = earlier["final_val_loss"]
            return math.nan if loss is None else loss  # null in summary.json: not finite
        # an earlier run of the sweep, or SLURM's requeue, stopped this job
        if cfg.trainer.resume is None and saved_checkpoints(status.job_dir):
            cfg.trainer.resume = "auto"
        try:
            summary = task(cfg, ranks)
        except ConfigError as error:
            log.warning("skipped: this combination cannot run: %s", error)
            status.write("skipped", str(error))
        except Interrupted:
            raise  # SIGINT/SIGTERM stop the whole sweep, not just this job
        except Exception as error:  # noqa: BLE001 - recorded, and the sweep goes on
            log.exception("job %s failed", hydra_cfg.job.num)
            status.write("failed", f"{type(error).__name__}: {error}")
        else:
            status.write("ok")
            return summary["final_val_loss"]
        finally:
            release_device_memory()
        return math.nan

    return job


def release_device_memory() -> None:
    """Hand the GPU memory that this job's tensors left cached back to the driver: the next job
    of the sweep runs in this process, maybe on other GPUs, and its peak counts from zero. (On
    the CPU the collector frees what a job left in its own time.)"""
    if torch.cuda.is_initialized():
        gc.collect()  # a failed job's traceback can hold its model and optimizer
        torch.cuda.empty_cache()


@dataclass
class JobStatus:
    """A sweep job's `status.json`, written by rank 0 of several ranks that srun started (each
    runs this job), and by the job's only process otherwise."""

    job_dir: Path
    ranks: Ranks | None

    def finished_summary(self) -> dict[str, Any] | None:
        """The summary of a job that an earlier run of the sweep finished (status ok), or None."""
        status_path, summary_path = status_file(self.job_dir), summary_file(self.job_dir)
        if not (status_path.exists() and summary_path.exists()):
            return None
        if json.loads(status_path.read_text())["status"] != "ok":
            return None
        return json.loads(summary_path.read_text())

    def write(self, status: str, reason: str = "") -> None:
        if self.ranks is not None and self.ranks.rank != 0:
            return
        self.job_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"status": status, "reason": reason}, indent=2) + "\n"
        status_file(self.job_dir).write_text(text)
