"""Throughput that identical jobs agree on, and a scaling report that says when its numbers
cannot be trusted (oversubscribed cores, noisy timings, efficiencies over 100%)."""

from __future__ import annotations

import csv
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import TINY

import src.training.trainer
from src.observe.report import write_report
from src.observe.tracking import Trackers
from src.parallel import build_strategy
from src.training.loop import Throughput
from src.training.trainer import train


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


class FirstLogTakes100s:
    """A tracker whose first `log` costs what a first call often costs once per process (lazy
    imports, a service starting), here 100 s on a clock that the test moves forward."""

    run_id = None

    def __init__(self, clock: list[float]):
        self.clock = clock

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.clock[0]:
            self.clock[0] = 100.0

    def log_model(self, folder: Path, metadata: dict) -> None:
        pass

    def finish(self, summary: dict | None = None, exit_code: int = 0) -> None:
        pass


def test_one_time_costs_of_logging_are_not_timed(compose_config, tmp_path, monkeypatch):
    """The first job of an in-process sweep pays such costs on its first log step, which is
    also where warm-up ends; they must not make its throughput look 100 times lower."""
    clock = [0.0]
    real_perf_counter = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_perf_counter() + clock[0])
    monkeypatch.setattr(
        src.training.trainer,
        "build_tracker",
        lambda *args: Trackers({"slow": FirstLogTakes100s(clock)}),
    )
    cfg = compose_config(*TINY, "trainer.log_every=2", "trainer.timing_warmup_steps=2")
    strategy = build_strategy(cfg.parallel, "cpu", "fp32")

    train(cfg, tmp_path, strategy)

    result = json.loads((tmp_path / "summary.json").read_text())
    assert clock[0] == 100.0, "the tracker logged"
    timed_samples = 4 * 24  # steps 3 to 6, after warm-up
    assert result["samples_per_sec"] > timed_samples / 10, "the 100 s first log was timed"
    assert result["step_time_spread"] >= 0
    # What the scaling report needs to see oversubscribed cores.
    assert result["processes_per_node"] == 1
    assert result["threads_per_process"] == torch.get_num_threads()
    assert result["cores"] == len(os.sched_getaffinity(0))


def test_without_warm_up_every_step_is_timed():
    speed = Throughput(warmup_steps=0, samples_per_step=10)
    for _ in range(3):
        speed.step_done(strategy=None)  # no warm-up to end: nothing to synchronize
    speed.close_window()

    assert speed.summary()["samples_per_sec"] > 0, "trainer.timing_warmup_steps=0 timed nothing"


@pytest.fixture
def saved_figures(monkeypatch) -> list[Any]:
    """The matplotlib figures saved during the test, kept to look at after drawing."""
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig

    def save_and_keep(figure: Figure, *args, **kwargs) -> None:
        figures.append(figure)
        save(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", save_and_keep)
    return figures


def write_job(
    sweep_dir: Path, job: int, strategy: str, devices: int, samples_per_sec: float, **figures
) -> None:
    """A finished job of a sweep, as `train.py -m` leaves it (what the report reads)."""
    job_dir = sweep_dir / str(job)
    (job_dir / ".hydra").mkdir(parents=True)
    config = {"parallel": {"name": strategy, "devices": devices, "nodes": 1}}
    (job_dir / ".hydra" / "config.yaml").write_text(json.dumps(config))
    overrides = [f"parallel={strategy}", f"parallel.devices={devices}"]
    (job_dir / ".hydra" / "overrides.yaml").write_text(json.dumps(overrides))
    (job_dir / "status.json").write_text(json.dumps({"status": "ok", "reason": ""}))
    summary = {
        "world_size": devices,
        "samples_per_sec": samples_per_sec,
        "step_time_ms": 256_000 / samples_per_sec,
        "final_train_loss": 1.0,
        "final_val_loss": 1.0,
        "peak_memory_mb": [100.0] * devices,
        "step_time_spread": 0.1,
        "processes_per_node": 1,
        "threads_per_process": 2,
        "cores": 2,
        **figures,
    }
    (job_dir / "summary.json").write_text(json.dumps(summary))


def test_report_flags_numbers_it_cannot_trust_and_says_why(tmp_path, saved_figures):
    write_job(tmp_path, 0, "single", 1, 1000.0)
    write_job(tmp_path, 1, "dp", 1, 1830.0)  # 183% efficiency
    write_job(tmp_path, 2, "ddp", 2, 1500.0, processes_per_node=2)  # 2 x 2 threads on 2 cores
    write_job(tmp_path, 3, "fsdp", 2, 1200.0, step_time_spread=0.9, threads_per_process=1)
    write_job(tmp_path, 4, "ddp", 4, 9000.0, processes_per_node=4, threads_per_process=1)

    rows = write_report(tmp_path)

    assert [row.flags for row in rows] == [
        "",
        "efficiency > 100%",
        "oversubscribed",
        "noisy",
        "oversubscribed, efficiency > 100%",
    ]
    assert [(row.threads, row.cores) for row in rows][1:3] == [(2, 2), (4, 2)]
    assert [row["flags"] for row in read_csv(tmp_path / "summary.csv")][2] == "oversubscribed"
    summary_md = (tmp_path / "summary.md").read_text()
    assert "| flags |" in summary_md.splitlines()[2]
    assert "| oversubscribed, efficiency > 100% |" in summary_md
    notes = summary_md.split("Flagged numbers cannot be trusted:")[1]
    assert "**oversubscribed** (jobs 2, 4): more threads" in notes
    assert "**noisy** (jobs 3): step times differ" in notes
    assert "**efficiency > 100%** (jobs 1, 4): faster per device than the single job" in notes
    (figure,) = saved_figures
    throughput, efficiency = (axes.collections[0].get_offsets().tolist() for axes in figure.axes)
    assert throughput == [[1, 1830], [2, 1500], [2, 1200], [4, 9000]]  # the flagged jobs, ringed
    assert efficiency == [[1, 1.83], [2, 0.75], [2, 0.6], [4, 2.25]]


def test_report_of_a_quiet_sweep_flags_nothing(tmp_path):
    write_job(tmp_path, 0, "single", 1, 1000.0)
    write_job(tmp_path, 1, "ddp", 2, 1900.0, processes_per_node=2, threads_per_process=1)
    write_job(tmp_path, 2, "dp", 1, 1004.0)  # 100%, as the table shows it
    write_job(tmp_path, 3, "dp", 2, float("nan"))  # too few steps to time any window

    rows = write_report(tmp_path)

    assert [row.flags for row in rows] == ["", "", "", ""]
    summary_md = (tmp_path / "summary.md").read_text()
    assert "Flagged" not in summary_md
    assert "tokens/s" not in summary_md  # no job trained on token sequences


def test_report_leaves_blank_what_a_job_could_not_measure(tmp_path, saved_figures):
    """summary.json's null: a job within its timing warm-up, tensor memory not counted."""
    write_job(tmp_path, 0, "single", 1, 1000.0)
    write_job(tmp_path, 1, "ddp", 2, 1000.0, tensor_peak_mb=[None, None])
    untimed = tmp_path / "1" / "summary.json"
    speeds = dict.fromkeys(("samples_per_sec", "step_time_ms", "step_time_spread"))
    untimed.write_text(json.dumps(json.loads(untimed.read_text()) | speeds))

    rows = write_report(tmp_path)

    assert [(row.samples_per_sec, row.speedup, row.tensor_peak_max_mb) for row in rows] == [
        (1000.0, 1.0, None),
        (None, None, None),
    ]
    ddp = (tmp_path / "summary.md").read_text().splitlines()[-1]
    assert ddp.startswith("| 1 | ddp | 2 | 2 |  |  |  |  |")


def test_report_shows_the_tokens_per_second_of_jobs_on_token_sequences(tmp_path):
    write_job(tmp_path, 0, "single", 1, 0.42, tokens_per_sec=430.08)
    write_job(tmp_path, 1, "ddp", 2, 12_345.4, tokens_per_sec=12_641_689.6)

    rows = write_report(tmp_path)

    assert [row.tokens_per_sec for row in rows] == [430.08, 12_641_689.6]
    header, _, single, ddp = [
        line for line in (tmp_path / "summary.md").read_text().splitlines() if line.startswith("|")
    ]
    assert "| samples/s | tokens/s |" in header
    assert "| 0.42 | 430 |" in single and "| 12,345 | 12,641,690 |" in ddp
    assert [row["tokens_per_sec"] for row in read_csv(tmp_path / "summary.csv")] == [
        "430.08",
        "12641689.6",
    ]


def test_plot_legend_hides_no_data_point(tmp_path, saved_figures):
    """A sweep of the `experiment=scaling` preset's shape whose throughputs left no room in
    either plot for a legend inside it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    speeds = iter(
        [2981, 3680, 2963, 4165, 2931, 4837, 3214, 3144, 2502, 3183, 2232, 3090, 1806, 1352, 1340]
        + [3257, 3455, 2644, 904]
    )
    job = itertools.count()
    for strategy in ["single", "dp", "dp_criterion", "ddp", "fsdp", "model_parallel", "hybrid"]:
        for devices in [1] if strategy == "single" else [1, 2, 4]:
            write_job(tmp_path, next(job), strategy, devices, float(next(speeds)))

    write_report(tmp_path)

    (figure,) = saved_figures
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    legends = [*figure.legends, *(axes.get_legend() for axes in figure.axes if axes.get_legend())]
    assert legends
    boxes = [legend.get_window_extent(renderer) for legend in legends]
    for axes in figure.axes:
        points = [line.get_xydata() for line in axes.get_lines() if line.get_marker() == "o"]
        points += [collection.get_offsets() for collection in axes.collections]
        for x, y in axes.transData.transform(np.concatenate(points)):
            assert not any(box.contains(x, y) for box in boxes), f"legend covers ({x}, {y})"
