"""submitit's side of the SLURM launcher (`hydra_plugins/parallel_training/slurm_launcher.py`):
submitting one job with its own settings, reading job states, collecting results. Imported only
by a sweep that runs on SLURM (submitit takes a third of a second to import)."""

from __future__ import annotations

import contextlib
import io
import logging
import math
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import submitit
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf
from submitit.slurm import slurm

log = logging.getLogger(__name__)

# The launcher's own settings; every other one goes to submitit's executor.
LAUNCHER_KEYS = {"submitit_folder", "max_num_timeout", "signal"}
# How often, at most, job states are read: well within MinJobAge (300 s by default), the time
# squeue keeps knowing a job that has ended.
POLL_AT_MOST_EVERY_S = 60


class SubmissionRefused(Exception):
    pass


def submit(params: dict[str, Any], job_num: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Submit `fn(*args)` as one SLURM job with these launcher settings, as hydra-submitit-launcher
    sets up its executor; the signal SLURM sends before the time limit is `params["signal"]`
    (sbatch's `--signal`). Raises SubmissionRefused with sbatch's reason if sbatch refuses it."""
    executor = submitit.AutoExecutor(
        folder=params["submitit_folder"], slurm_max_num_timeout=params["max_num_timeout"]
    )
    queue_keys = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(
        **{
            key if key in queue_keys else f"slurm_{key}": value
            for key, value in params.items()
            if key not in LAUNCHER_KEYS
        }
    )
    sbatch_flags = {**(params.get("additional_parameters") or {}), "signal": params["signal"]}
    executor.update_parameters(slurm_additional_parameters=sbatch_flags)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's errors there
            return executor.submit(fn, *args)
    except submitit.core.utils.FailedJobError as error:
        reason = str(error).strip().splitlines()[-1].removeprefix("sbatch: error: ")
        raise SubmissionRefused(f"sbatch refused job {job_num}: {reason}") from None


def job_result(job: Any, overrides: Sequence[str]) -> JobReturn:
    """The job's JobReturn; for a job that ended without one (cancelled, killed at its time
    limit, its node lost), a NaN result: the sweep's report counts it as failed."""
    try:
        return job.results()[0]
    except submitit.core.utils.UncompletedJobError:
        log.error("job %s (%s) ended without a result", job.job_id, " ".join(overrides))
        return JobReturn(
            overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=math.nan
        )


def watch_job_states() -> None:
    """Read job states with squeue where sacct fails (accounting off, as on many small
    clusters), saying so once, instead of submitit's warning on every poll."""
    if not isinstance(slurm.SlurmJob.watcher, SqueueWhereNoAccounting):
        slurm.SlurmJob.watcher = SqueueWhereNoAccounting(delay_s=POLL_AT_MOST_EVERY_S)


class SqueueWhereNoAccounting(slurm.SlurmInfoWatcher):
    """submitit's sacct watcher, which turns to squeue once sacct has failed. (submitit's own
    keeps asking sacct, printing sacct's error and its warning on every poll, and never learns
    that a job ended without a result: it would wait for it forever.)"""

    accounting_off = False

    def _make_command(self) -> list[str] | None:
        command = super()._make_command()
        if command is None or not self.accounting_off:
            return command
        job_ids = [command[i + 1] for i, word in enumerate(command) if word == "-j"]
        return ["squeue", "--states=all", "--format=%i|%T", f"--jobs={','.join(job_ids)}"]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string.decode() if isinstance(string, bytes) else string
        if self.accounting_off:  # squeue's header, JOBID|STATE, in sacct's words
            text = "JobID|State" + text[text.find("\n") :] if "\n" in text else ""
        return super().read_info(text)

    def update(self) -> None:
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        found = subprocess.run(command, capture_output=True, text=True)
        if found.returncode and not self.accounting_off:
            self.accounting_off = True
            said = found.stderr.strip().splitlines()
            log.info("%s: job states come from squeue", said[-1] if said else "sacct failed")
            self.update()
            return
        if found.returncode == 0:
            self._info_dict.update(self.read_info(found.stdout))
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)
