"""Real multiruns through `train.py`: the scaling report, job outcomes, W&B groups, launchers.
(Sweeps on a real SLURM cluster: tests/test_slurm.py.)"""

from __future__ import annotations

import csv
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    ROOT,
    STRATEGIES,
    TINY,
    run_sweep,
    wandb_history,
    wandb_records,
)
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

from hydra_plugins.parallel_training.slurm_launcher import SlurmLauncher, slurm_resources
from src.config.schema import register_configs


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


@pytest.mark.equivalence
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
        assert float(row["predicted_peak_mb"]) > 0
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

    # One more run in the group, in the sweep dir: the table and the plot, as W&B media files.
    (report,) = [r.run for r in wandb_records(sweep_dir) if r.WhichOneof("record_type") == "run"]
    assert report.run_group == str(sweep_dir) and report.job_type == "scaling-report"
    (logged,) = wandb_history(sweep_dir)
    (files,) = sweep_dir.glob("wandb/offline-run-*/files")
    assert logged["scaling/table/_type"] == "table-file"  # media: a file, its fields in history
    table = json.loads((files / logged["scaling/table/path"]).read_text())
    assert {"tflops_per_sec", "mfu", "samples_per_sec", "efficiency"} <= set(table["columns"])
    logged_rows = [dict(zip(table["columns"], values, strict=True)) for values in table["data"]]
    assert [row["status"] for row in logged_rows] == ["ok", "skipped", "ok", "ok"]
    assert [row["tflops_per_sec"] for row in logged_rows] == [
        float(row["tflops_per_sec"]) if row["tflops_per_sec"] else None for row in rows
    ]
    assert logged["scaling/plot/_type"] == "image-file"
    plot = files / logged["scaling/plot/path"]
    assert plot.read_bytes() == (sweep_dir / "scaling.png").read_bytes()

    # By hand on the same directory: a job killed before it wrote anything now reads as failed.
    killed = sweep_dir / by_job["dp", 2]["job"]
    (killed / "status.json").unlink()
    (killed / "summary.json").unlink()
    rebuilt = subprocess.run(
        [sys.executable, "-m", "src.observe.report", str(sweep_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert rebuilt.returncode == 1 and "1 of 4 jobs failed" in rebuilt.stderr
    rows = read_csv(sweep_dir / "summary.csv")
    assert [row["status"] for row in rows] == ["ok", "skipped", "ok", "failed"]
    assert "did not finish" in rows[3]["reason"]


def test_a_crashing_job_is_recorded_and_the_sweep_exits_non_zero(tmp_path):
    # FaultyMLP raises in its first training step (tests/faulty_models.py). The next job still
    # runs.
    sweep_dir = tmp_path / "sweep"
    models = "model._target_=tests.faulty_models.FaultyMLP,src.components.models.MLP"
    fault = {"FAULT": "raise", "FAIL_AT_STEP": "1", "FAIL_RANK": "0"}
    result = run_sweep(models, *TINY, sweep_dir=sweep_dir, env=fault)
    assert result.returncode != 0
    assert "1 of 2 jobs failed" in result.stderr
    crashed, ok = read_csv(sweep_dir / "summary.csv")
    assert (ok["variant"], ok["status"]) == ("model._target_=src.components.models.MLP", "ok")
    faulty = "model._target_=tests.faulty_models.FaultyMLP"
    assert (crashed["variant"], crashed["status"]) == (faulty, "failed")
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
    # By name: Hydra's plugin scan loads the module afresh, so the class is not the imported one.
    assert type(launcher).__module__ == SlurmLauncher.__module__
    assert type(launcher).__name__ == "SlurmLauncher"
    assert launcher.params["partition"] == "gpu" and launcher.params["timeout_min"] == 60

    def resources(*overrides: str) -> tuple[int, int, int]:
        found = slurm_resources(compose_with_hydra(*overrides))
        return found["nodes"], found["tasks_per_node"], found["gpus_per_node"]

    assert resources("parallel=single") == (1, 1, 1)
    assert resources("parallel=dp", "parallel.devices=4") == (1, 1, 4)  # one process, 4 GPUs
    assert resources("parallel=dp", "parallel.devices=4", "trainer.accelerator=cpu") == (1, 1, None)
    assert resources("parallel=ddp", "parallel.devices=8") == (1, 8, 8)  # one task per GPU
    assert resources("parallel=hybrid", "parallel.devices=8") == (1, 4, 8)  # 2 stages a task
    assert resources("parallel=fsdp", "parallel.devices=8") == (1, 8, 8)
    two_nodes = ("parallel.nodes=2",)  # srun gives the rendezvous: no master_port needed
    assert resources("parallel=ddp", "parallel.devices=4", *two_nodes) == (2, 4, 4)
    assert resources("parallel=single", "parallel.devices=2") == (1, 1, None)  # only says why not
    cpu_partition = ("hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0")
    cpu_partition += ("trainer.accelerator=auto",)
    assert resources("parallel=ddp", "parallel.devices=2", *cpu_partition) == (1, 2, None)


def test_concurrent_preset_composes_the_concurrent_launcher():
    cfg = compose_with_hydra("hydra/launcher=concurrent", "hydra.launcher.n_jobs=3")
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "ConcurrentLauncher"
    assert launcher.n_jobs == 3


def test_scaling_preset_sweeps_every_strategy_over_device_counts():
    cfg = compose_with_hydra("experiment=scaling")
    params = cfg.hydra.sweeper.params
    assert set(params.parallel.split(",")) == set(STRATEGIES), "add new strategies to the preset"
    assert params["parallel.devices"] == "1,2,4"
    assert cfg.trainer.max_steps <= 100
