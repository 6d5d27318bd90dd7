"""`hydra/launcher=concurrent`: jobs of a sweep at once, each on devices of its own."""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path

import pytest
from helpers import TINY, TrainRun, pretend_gpus, summary

from src.launch.concurrent_jobs import device_pools

TIMESTAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]", re.MULTILINE)


def log_times(job_dir: Path) -> tuple[datetime, datetime]:
    """When the job's train.log begins and ends."""
    stamps = TIMESTAMP.findall((job_dir / "train.log").read_text())
    first, last = (
        datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f") for stamp in stamps[:: len(stamps) - 1]
    )
    return first, last


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_concurrent_jobs_each_take_cores_of_their_own(tmp_path):
    sweep_dir = tmp_path / "sweep"
    own = os.sched_getaffinity(0)
    two_cores = sorted(own)[:2]
    os.sched_setaffinity(0, two_cores)  # the sweep's machine: two cores
    try:
        run = TrainRun("hydra/launcher=concurrent", "seed=0,1,2", *TINY, sweep_dir=sweep_dir)
    finally:
        os.sched_setaffinity(0, own)
    result = run.finish(check=True)

    jobs = [sweep_dir / str(num) for num in range(3)]
    affinities = [summary(job)["cpu_affinity"] for job in jobs]
    assert affinities[:2] == [[two_cores[0]], [two_cores[1]]]  # one core each, at once
    assert [summary(job)["cores"] for job in jobs] == [1, 1, 1]
    assert result.stdout.index("#1 : ") < result.stdout.index("run summary")
    # Job 2 waited for a core: it began after the job that had that core had ended.
    (core,) = affinities[2]
    before = jobs[affinities.index([core])]
    assert log_times(jobs[2])[0] > log_times(before)[1]
    assert (sweep_dir / "summary.md").read_text().count("| ok |") == 3


@pytest.mark.parametrize(
    "visible, pool",
    [
        (None, ["0", "1"]),
        ("3,5", ["3", "5"]),
        ("GPU-8f2c,MIG-1a2b", ["GPU-8f2c", "MIG-1a2b"]),  # a container's or MIG's UUIDs
        ("2,7,9", ["2", "7"]),  # CUDA stops at a GPU it cannot use: 2 counted
    ],
)
def test_jobs_get_gpus_by_the_names_cuda_visible_devices_gives(monkeypatch, visible, pool):
    """A job's CUDA_VISIBLE_DEVICES names its GPUs as this process's does, if set."""
    pretend_gpus(monkeypatch, 2)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert device_pools()["cuda"] == pool
