"""Sweeps through `hydra/launcher=slurm` on a real SLURM cluster: this machine as one node of 2
CPUs, started for the session (`tests/slurm_cluster.py`), without accounting and without GPUs."""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

import pytest
from helpers import (
    TINY_SGD,
    TrainRun,
    assert_same_training,
    metrics,
    reference_run,
    run_sweep,
)
from slurm_cluster import Cluster, needs_slurm

pytestmark = needs_slurm()

ON_SLURM = ("hydra/launcher=slurm", "hydra.launcher.partition=debug")
POLL_S = 0.05


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def job_ids(sweep_dir: Path) -> list[str]:
    """The SLURM job ids of a sweep's jobs, in the order they were submitted."""
    folders = (path.name for path in (sweep_dir / ".submitit").iterdir() if path.is_dir())
    return sorted((name for name in folders if name.isdigit()), key=int)


def submission_scripts(sweep_dir: Path) -> list[str]:
    return [
        (sweep_dir / ".submitit" / job / f"{job}_submission.sh").read_text()
        for job in job_ids(sweep_dir)
    ]


def logged_steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in metrics(run_dir) if "train/loss" in row]


def wait_for_step(run_dir: Path, step: int, run: TrainRun) -> None:
    """Until the job in `run_dir` has logged `step` (the sweep `run` still going)."""
    path = run_dir / "metrics.jsonl"
    while not (path.exists() and any(s >= step for s in steps_so_far(path))):
        assert run.process.poll() is None, "the sweep ended first"
        time.sleep(POLL_S)


def steps_so_far(path: Path) -> list[int]:
    lines = path.read_text().splitlines()
    return [json.loads(line)["step"] for line in lines[:-1]]  # the last may be half-written


def test_sweep_on_slurm_reports_and_runs_ddp_as_the_ranks_slurm_started(slurm: Cluster, tmp_path):
    """Each job is its own SLURM job, sized from its config: ddp one task per device, each task a
    rank of a real gloo group made from SLURM's variables (nothing launches processes of its own),
    and a combination that cannot run (`single` on 2 devices) one task, to record itself as
    skipped. No GPUs are asked for on the CPU. The sweep ends with its table. (`single` runs to
    its end on SLURM in test_time_limit_signal_checkpoints_requeues_and_resumes.)"""
    sweep_dir = tmp_path / "sweep"
    result = run_sweep(
        *ON_SLURM, "parallel=single,ddp", "parallel.devices=2", *TINY_SGD,
        sweep_dir=sweep_dir, env=slurm.env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Scaling report" in result.stdout and "| ddp | 2 | 2 |" in result.stdout
    rows = read_csv(sweep_dir / "summary.csv")
    assert [(row["strategy"], row["status"]) for row in rows] == [
        ("single", "skipped"), ("ddp", "ok"),
    ]  # fmt: skip
    scripts = submission_scripts(sweep_dir)
    tasks = [re.search(r"--ntasks-per-node=(\d+)", script).group(1) for script in scripts]
    assert tasks == ["1", "2"]
    assert not any("gpus" in script or "gres" in script for script in scripts)
    assert all("#SBATCH --signal=USR2@120" in script for script in scripts)

    ddp_dir = sweep_dir / rows[1]["job"]
    assert_same_training(reference_run(*TINY_SGD), ddp_dir)
    log = (ddp_dir / "train.log").read_text()
    assert "[rank0]" in log and "[rank1]" in log and "launching" not in log
    # Accounting is off here: one line says so, instead of submitit's warnings at every poll.
    console = result.stdout + result.stderr
    assert "Bypassing sacct error" not in console and "storage is disabled\n" not in console
    assert console.count("job states come from squeue") == 1


def test_a_job_sbatch_refuses_ends_the_sweep_in_one_line(slurm: Cluster, tmp_path):
    """The second job asks for GPUs (trainer.accelerator=auto) on a cluster without any: sbatch
    refuses it, the sweep says why in one line (exit 2) and cancels the job it had submitted."""
    sweep_dir = tmp_path / "sweep"
    result = run_sweep(
        *ON_SLURM, "trainer.accelerator=cpu,auto", *TINY_SGD, sweep_dir=sweep_dir, env=slurm.env
    )
    (submitted,) = job_ids(sweep_dir)
    assert result.returncode == 2, result.stderr[-4000:]
    assert result.stderr.splitlines() == [
        "train.py: error: sbatch refused job 1: Invalid generic resource (gres) specification; "
        f"cancelled jobs {submitted}"
    ]
    # A job cancelled while running stays in the queue as COMPLETING until slurmd has killed it.
    assert slurm.states_until_gone(submitted) <= {"COMPLETING"}
    assert not list(sweep_dir.glob("*/summary.json"))  # cancelled, not run to its end


# The MLP, whose steps take 0.1 s or more in a job's first run (it waits, using no CPU): a run
# still training when a signal comes, however quick the machine; requeued, it trains at full speed.
PACED = "model._target_=tests.odd_models.PacedMLP"
STOPPED_AND_RESUMED = (
    *TINY_SGD[1:],  # all but max_steps
    "trainer.checkpoint_every=0",  # the stop's checkpoint is the only one
    "optimizer.schedule=constant",
)


def start_sweep(slurm: Cluster, tmp_path: Path, *overrides: str) -> tuple[TrainRun, Path]:
    """A sweep through the SLURM launcher, started (not waited for), and its folder."""
    sweep_dir = tmp_path / "sweep"
    return TrainRun(*ON_SLURM, *overrides, sweep_dir=sweep_dir, env=slurm.env), sweep_dir


def assert_resumed_as_if_uninterrupted(job_dir: Path, reference: Path, max_steps: int) -> None:
    """The job's run ended where an uninterrupted run does, its metrics.jsonl has every
    step once, and its summary says it completed."""
    assert_same_training(reference, job_dir)
    assert logged_steps(job_dir) == list(range(1, max_steps + 1))
    assert json.loads((job_dir / "status.json").read_text())["status"] == "ok"


@pytest.mark.equivalence
def test_requeued_ddp_job_checkpoints_on_every_rank_and_resumes(slurm: Cluster, tmp_path):
    """`scontrol requeue` of a running ddp job (paced: still training when it comes): SLURM sends
    SIGTERM to both ranks, which stop after the same step, checkpointed; the job runs again and
    resumes from that checkpoint without trainer.resume=auto, and the sweep waits for it."""
    steps = ("trainer.max_steps=50", *STOPPED_AND_RESUMED)
    ddp = ("parallel=ddp", "parallel.devices=2")
    sweep, sweep_dir = start_sweep(slurm, tmp_path, PACED, *ddp, *steps)
    job_dir = sweep_dir / "0"
    wait_for_step(job_dir, 10, sweep)
    (job_id,) = job_ids(sweep_dir)
    slurm.run("scontrol", "requeue", job_id)
    result = sweep.finish(timeout=240)

    assert result.returncode == 0, result.stderr[-4000:]
    log = (job_dir / "train.log").read_text()
    stopped = re.findall(r"\[rank(\d)\].*stopped by SIGTERM after step (\d+)", log)
    assert len(stopped) == 2 and stopped[0][1] == stopped[1][1], stopped
    step = int(stopped[0][1])
    assert "resume with" not in log and "it resumes when its sweep runs again" in log
    assert f"resuming from {job_dir / 'checkpoints' / f'step-{step:06d}'} at step {step}" in log
    # Against single's plain MLP.
    assert_resumed_as_if_uninterrupted(job_dir, reference_run(*steps), 50)


def test_time_limit_signal_checkpoints_requeues_and_resumes(slurm: Cluster, tmp_path):
    """A job with a 1-minute time limit that needs more: SLURM's signal before the limit
    (USR2, `hydra.launcher.signal`) stops the run after a step, checkpointed; the job requeues
    itself and its next run trains the rest.

    slurmctld sends that signal when it checks time limits, every 30 s from its start, at the
    first check that is less than 30 s before the signal is due: for USR2@5 and a 1-minute limit,
    at the first check 25 s or more after the job started (earlier, the task could be starting,
    with no handler yet). Once the job trains, the test restarts slurmctld, so that the check
    comes 30 s later: the job could train 40 s (a paced model, which waits rather than
    computes), and its next run, unpaced, is done in a few seconds, long before its own signal."""
    paced = (PACED, "trainer.max_steps=400")
    steps = (*paced, *STOPPED_AND_RESUMED, "trainer.log_every=1")
    limit = ("hydra.launcher.timeout_min=1", "hydra.launcher.signal=USR2@5")
    sweep, sweep_dir = start_sweep(slurm, tmp_path, *limit, *steps)
    job_dir = sweep_dir / "0"
    wait_for_step(job_dir, 1, sweep)
    slurm.restart_controller()
    result = sweep.finish(timeout=540)

    assert result.returncode == 0, result.stderr[-4000:]
    log = (job_dir / "train.log").read_text()
    assert "SIGUSR2 received: stopping after the current step" in log
    (job_log,) = sweep_dir.glob(".submitit/*/*_0_log.out")
    assert "requeued: it resumes from its checkpoint" in job_log.read_text()
    reference = reference_run(*[o for o in steps if o != PACED])  # the plain MLP
    assert_resumed_as_if_uninterrupted(job_dir, reference, 400)
