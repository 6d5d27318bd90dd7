"""Every logger of `conf/logger/` at once (`logger=many`): what each wrote, read back with its own
library's reader (TensorBoard's EventAccumulator, MlflowClient on the file store, the csv module),
after a ddp x2 run and two resumes; a logger that fails, and one whose package is missing."""

from __future__ import annotations

import csv
import logging
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, TINY, checkpoint, on_cpu, run_train, summary, train_losses
from omegaconf import OmegaConf

from src.config.base import ConfigError
from src.observe.tracking import Tracker, Trackers, build_tracker, check_tracker


@pytest.mark.timeout(300)
def test_a_resumed_run_continues_each_loggers_run_when_launched_or_under_torchrun(
    tmp_path, monkeypatch
):
    """ddp's launched ranks train 3 steps and lose their step-3 checkpoint (as a crash after the
    step's log would), resume from step 2 to 5, then torchrun's ranks resume to 6: each logger
    holds one run of steps 1 to 6 (MLflow keeps step 3 twice: its metrics cannot be deleted)."""
    overrides = [
        *(o for o in TINY if o != "logger=none"),
        "logger=many",
        "parallel=ddp",
        "parallel.devices=2",
        "trainer.checkpoint_every=2",
        "optimizer.schedule_steps=6",  # the same schedule whatever trainer.max_steps says
    ]
    run_train(*overrides, "trainer.max_steps=3", run_dir=tmp_path)
    run_ids = checkpoint(tmp_path)["tracker_run_ids"]
    shutil.rmtree(tmp_path / "checkpoints" / "step-000003")
    resumed = (*overrides, "trainer.resume=auto")
    run_train(*resumed, "trainer.max_steps=5", run_dir=tmp_path)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [*torchrun, "train.py", *on_cpu((*resumed, "trainer.max_steps=6"))]
    command.append(f"hydra.run.dir={tmp_path}")
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    assert checkpoint(tmp_path)["step"] == 6
    assert checkpoint(tmp_path)["tracker_run_ids"] == run_ids and run_ids.keys() == {
        "wandb",
        "mlflow",
    }
    runs = sorted(path.name for path in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 3 and all(name.endswith(f"-{run_ids['wandb']}") for name in runs), runs
    losses, final, group = train_losses(tmp_path), summary(tmp_path), str(tmp_path)
    assert len(losses) == 6

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")  # step 3 of the first run purged
    assert [e.step for e in scalars] == list(range(1, 7))
    assert [e.value for e in scalars] == pytest.approx(losses, rel=1e-6)
    last = events.Scalars("summary/final_val_loss")[-1]  # each run that ended logged its own
    assert (last.step, last.value) == (6, pytest.approx(final["final_val_loss"]))
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["trainer.max_steps"].number_value == 3, "the first run's, as MLflow's"
    assert hparams["logger.group"].string_value == group

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("parallel-training")
    (run,) = client.search_runs([experiment.experiment_id])
    assert (run.info.run_id, run.info.run_name, run.info.status) == (
        run_ids["mlflow"],
        "ddp-2",
        "FINISHED",
    )
    assert run.data.tags["group"] == group and run.data.tags["job_type"] == "ddp"
    assert run.data.params["trainer.max_steps"] == "3", "a param keeps its first value"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert sorted(history) == list(range(1, 7))
    assert [history[step] for step in range(1, 7)] == pytest.approx(losses, rel=1e-12)
    assert run.data.metrics["summary/final_val_loss"] == pytest.approx(final["final_val_loss"])

    with (tmp_path / "metrics.csv").open(newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["train/loss"]]
    assert [int(row["step"]) for row in rows] == list(range(1, 7))
    assert [float(row["train/loss"]) for row in rows] == losses
    config = OmegaConf.load(tmp_path / "hparams.yaml")
    assert (config.trainer.max_steps, config.logger.group) == (6, group)


class Failing(Tracker):
    """A logger whose server died: every call raises."""

    run_id = "r1"

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise OSError("No space left on device")


def test_a_failing_logger_warns_once_and_the_others_go_on(tmp_path, caplog, compose_config):
    """A logger that fails mid-run is left out after one warning, its run id kept for a resume;
    one that cannot start (its folder under a file) is left out with one warning."""
    (tmp_path / "file").write_text("")
    under_a_file = f"logger.tensorboard.log_dir={tmp_path / 'file' / 'tensorboard'}"
    cfg = compose_config("logger=[csv,tensorboard]", under_a_file).logger
    with caplog.at_level(logging.WARNING):
        started = build_tracker(cfg, tmp_path, {"seed": 0}, is_main=True)
        trackers = Trackers({"failing": Failing(), **started.trackers})
        for step in (1, 2):
            trackers.log({"train/loss": 1.0 / step}, step)
        trackers.finish({"steps": 2})
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("tensorboard could not start (")
    assert warnings[1] == "failing could not log, continuing without it: No space left on device"
    assert trackers.run_ids == {"failing": "r1"}
    with (tmp_path / "metrics.csv").open(newline="") as file:
        assert [row["step"] for row in csv.DictReader(file)] == ["1", "2"]


def test_a_logger_without_its_package_is_one_line_naming_it(compose_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(ConfigError) as refused:
        check_tracker(compose_config("logger=[csv,mlflow]").logger)
    assert str(refused.value) == "logger=mlflow needs mlflow: pip install mlflow-skinny"


def test_no_logger_library_is_imported_until_chosen():
    code = (
        "import sys, src.training.build; "
        "assert not {'wandb', 'mlflow', 'tensorboard'} & sys.modules.keys()"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
