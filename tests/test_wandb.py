"""Real offline W&B runs written by `train.py`, read back from the run file (a resumed run:
`test_loggers.py`)."""

from __future__ import annotations

import json

from helpers import TINY, run_train, summary, wandb_history, wandb_records


def test_offline_run_logs_history_config_and_summary(tmp_path):
    overrides = [o for o in TINY if o != "logger=none"]
    run_train(*overrides, "logger=wandb", "logger.group=g1", "logger.tags=[a,b]", run_dir=tmp_path)

    history = wandb_history(tmp_path)
    train_rows = [row for row in history if "train/loss" in row]
    assert [row["_step"] for row in train_rows] == list(range(1, 7))
    assert {"train/lr", "train/samples_per_sec", "train/step_time_ms"} <= train_rows[0].keys()
    assert any("val/accuracy" in row for row in history)

    records = wandb_records(tmp_path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_group == "g1" and list(run.tags) == ["a", "b"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"]["max_steps"] == 6 and config["parallel"]["name"] == "single"
    assert config["logger"]["run_name"] == "single-1", "the logged config must be resolved"
    assert run.display_name == "single-1" and run.job_type == "single"

    summary_items = {
        item.key: item.value_json
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for item in r.summary.update
    }
    assert float(summary_items["final_val_loss"]) == summary(tmp_path)["final_val_loss"]
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0


def test_the_best_checkpoint_is_the_runs_model_artifact_when_asked(tmp_path):
    overrides = [o for o in TINY if o != "logger=none"]
    run_train(*overrides, "logger=wandb", "logger.wandb.log_checkpoints=true", run_dir=tmp_path)
    records = wandb_records(tmp_path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert (artifact.name, artifact.type) == (f"model-{run.run_id}", "model")
    assert "best" in artifact.aliases
    assert json.loads(artifact.metadata)["best_step"] == summary(tmp_path)["best_step"]
    files = {entry.path for entry in artifact.manifest.contents}
    assert files == {"checkpoint.pt", "manifest.json"}
