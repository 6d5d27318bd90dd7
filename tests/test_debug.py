"""`debug=<mode>` (conf/debug/): each composes and runs through train.py to the end, quickly."""

from __future__ import annotations

import pytest
from helpers import metrics, options, run_train, summary, train_losses

SMALL = ("model.hidden=32", "model.depth=3", "data.num_samples=600")


def test_the_debug_modes_are_fdr_overfit_and_profile():
    assert options("debug") == ["fdr", "overfit", "profile"]


def test_fdr_trains_and_evaluates_one_step_and_writes_no_checkpoint_or_logger(tmp_path):
    run_train("debug=fdr", *SMALL, run_dir=tmp_path)
    assert summary(tmp_path)["steps"] == 1
    assert any("val/loss" in row for row in metrics(tmp_path))
    assert "test_loss" in summary(tmp_path)
    assert not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "wandb").exists()  # logger=none


def test_overfit_drives_the_loss_of_a_few_batches_far_down(tmp_path):
    """The default MLP (hidden 256; SMALL's 32 would need more steps to memorise them)."""
    run_train("debug=overfit", "data.num_samples=600", "logger=none", run_dir=tmp_path)
    losses = train_losses(tmp_path)
    assert len(losses) == 10 and losses[-1] < losses[0] / 10
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.timeout(300)
def test_profile_records_a_trace_of_a_few_steps(tmp_path):
    run_train("debug=profile", *SMALL, "logger=none", run_dir=tmp_path)
    assert (tmp_path / "profile_trace.json").stat().st_size > 0
    assert summary(tmp_path)["steps"] == 6
    assert not (tmp_path / "checkpoints").exists()
