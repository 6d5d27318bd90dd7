"""Real multiruns through `train.py`: the scaling report, job outcomes, W&B groups, launchers."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, TINY, wandb_records
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

from src.config import register_configs
from src.launchers import SlurmLauncher, slurm_resources


def run_sweep(*overrides: str, sweep_dir: Path) -> subprocess.CompletedProcess:
    """`python train.py -m <overrides> hydra.sweep.dir=<sweep_dir>` in a subprocess."""
    return subprocess.run(
        [sys.executable, "train.py", "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WANDB_SILENT": "true"},
    )


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG header (signature, then the IHDR chunk)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def test_sweep_reports_every_job_and_groups_its_wandb_runs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    tiny = [o for o in TINY if o != "logger=none"]
    result = run_sweep("parallel=single,dp", "parallel.devices=1,2", *tiny, sweep_dir=sweep_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Scaling report" in result.stdout and "| dp | 2 |" in result.stdout

    rows = read_csv(sweep_dir / "summary.csv")
    by_job = {(row["strategy"], int(row["devices"])): row for row in rows}
    assert list(by_job) == [("single", 1), ("single", 2), ("dp", 1), ("dp", 2)]
    assert [row["status"] for row in rows] == ["ok", "skipped", "ok", "ok"]
    assert "parallel.devices=2" in by_job["single", 2]["reason"]
    assert float(by_job["single", 1]["speedup"]) == 1.0
    for key in [("dp", 1), ("dp", 2)]:
        row = by_job[key]
        assert float(row["efficiency"]) == float(row["speedup"]) / key[1]
        assert float(row["samples_per_sec"]) > 0 and float(row["peak_memory_max_mb"]) > 0
        assert (
            abs(float(row["final_val_loss"]) - float(by_job["single", 1]["final_val_loss"])) < 1e-5
        )
    table = (sweep_dir / "summary.md").read_text()
    assert table.count("\n| ") == 1 + len(rows)  # header and one line per job
    width, height = png_size(sweep_dir / "scaling.png")
    assert width > 400 and height > 200

    runs = [
        next(
            r.run
            for r in wandb_records(sweep_dir / row["job"])
            if r.WhichOneof("record_type") == "run"
        )
        for row in rows
        if row["status"] == "ok"
    ]
    assert {run.run_group for run in runs} == {str(sweep_dir)}
    assert [run.display_name for run in runs] == ["single-1", "dp-1", "dp-2"]
    assert [run.job_type for run in runs] == ["single", "dp", "dp"]
    assert len({run.run_id for run in runs}) == 3

    # By hand on the same directory: a job killed before it wrote anything now reads as failed.
    killed = sweep_dir / by_job["dp", 2]["job"]
    (killed / "status.json").unlink()
    (killed / "summary.json").unlink()
    rebuilt = subprocess.run(
        [sys.executable, "-m", "src.report", str(sweep_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert rebuilt.returncode == 1 and "1 of 4 jobs failed" in rebuilt.stderr
    rows = read_csv(sweep_dir / "summary.csv")
    assert [row["status"] for row in rows] == ["ok", "skipped", "ok", "failed"]
    assert "did not finish" in rows[3]["reason"]


def test_a_crashing_job_is_recorded_and_the_sweep_exits_non_zero(tmp_path):
    # The transformer cannot embed the synthetic float features: a crash in the first step. The
    # next job still runs.
    sweep_dir = tmp_path / "sweep"
    result = run_sweep("model=transformer,mlp", *TINY, sweep_dir=sweep_dir)
    assert result.returncode != 0
    assert "1 of 2 jobs failed" in result.stderr
    crashed, ok = read_csv(sweep_dir / "summary.csv")
    assert (ok["variant"], ok["status"]) == ("model=mlp", "ok")
    assert (crashed["variant"], crashed["status"]) == ("model=transformer", "failed")
    assert crashed["reason"].startswith("RuntimeError")
    status = json.loads((sweep_dir / crashed["job"] / "status.json").read_text())
    assert status["status"] == "failed"
    assert "Traceback" in (sweep_dir / crashed["job"] / "train.log").read_text()


def compose_with_hydra(*overrides: str) -> DictConfig:
    """The job config with its `hydra` node, as a multirun job sees it."""
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_slurm_preset_sizes_each_job_from_its_parallel_settings():
    cfg = compose_with_hydra("hydra/launcher=slurm", "hydra.launcher.partition=gpu")
    launcher = instantiate(cfg.hydra.launcher)
    assert isinstance(launcher, SlurmLauncher)
    assert launcher.params["partition"] == "gpu" and launcher.params["timeout_min"] == 60

    def resources(*overrides: str) -> tuple[int, int, int]:
        found = slurm_resources(compose_with_hydra(*overrides))
        return found["nodes"], found["tasks_per_node"], found["gpus_per_node"]

    assert resources("parallel=single") == (1, 1, 1)
    assert resources("parallel=dp", "parallel.devices=4") == (1, 1, 4)  # one process, 4 GPUs
    assert resources("parallel=dp", "parallel.devices=4", "trainer.accelerator=cpu") == (1, 1, 0)


def test_concurrent_preset_composes_the_joblib_launcher():
    cfg = compose_with_hydra("hydra/launcher=concurrent", "hydra.launcher.n_jobs=3")
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "JoblibLauncher"
    assert launcher.joblib["n_jobs"] == 3
