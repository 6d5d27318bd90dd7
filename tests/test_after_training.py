"""After training: the test pass on the held-out test split, the best checkpoint of
`trainer.monitor`, and early stopping, through `train.py` under several layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY, TINY_SGD, evaluate_checkpoint, metrics, run_train, strategy_runs, summary

from src.checkpoint.store import best_dir, is_sharded, load_checkpoint, resume_path
from src.checkpoint.writer import CheckpointWriter
from src.config.parallel import ParallelConfig
from src.parallel.base import Strategy

# Evaluations at steps 2, 4 and 6. Under SGD the validation loss falls from step to step, so
# `monitor_mode=max` makes the first evaluation the best: a best checkpoint that is not the last.
BEST = (
    *TINY_SGD,
    "trainer.eval_every=2",
    "trainer.monitor_mode=max",
    "trainer.keep_checkpoints=1",
)
# ... and with a patience of 2, the run stops after the evaluations at steps 4 and 6.
EARLY_STOP = (*BEST, "trainer.max_steps=20", "trainer.early_stop_patience=2")


def best_runs() -> dict:
    return strategy_runs(*BEST, strategies=("ddp", "fsdp"))


def val_losses(run_dir) -> dict[int, float]:
    return {row["step"]: row["val/loss"] for row in metrics(run_dir) if "val/loss" in row}


def test_the_test_split_is_scored_after_training_alike_under_every_layout():
    runs = best_runs()
    expected = summary(runs["single"])
    for run_dir in runs.values():
        figures = summary(run_dir)
        assert figures["test_step"] == figures["steps"] == 6
        for name in ("test_loss", "test_accuracy"):
            assert figures[name] == pytest.approx(expected[name], rel=0, abs=1e-5)
        (row,) = [row for row in metrics(run_dir) if "test/loss" in row]
        assert row == {
            "step": 6,
            "test/loss": figures["test_loss"],
            "test/accuracy": figures["test_accuracy"],
        }
    # The final model's figures on the test split, which are not the validation split's.
    tested = evaluate_checkpoint(runs["single"], "test")
    torch.testing.assert_close(
        torch.tensor(tested), torch.tensor([expected["test_loss"], expected["test_accuracy"]])
    )
    assert expected["test_loss"] != pytest.approx(expected["final_val_loss"], abs=1e-4)
    report = (runs["single"].parent / "summary.md").read_text()  # the sweep's table
    assert "| val loss | test loss |" in report
    assert f"| {expected['test_loss']:.4f} |" in report


def test_a_run_without_a_test_split_trains_and_tests_nothing(tmp_path):
    run_train(*TINY, "data.test_fraction=0", "trainer.test=false", run_dir=tmp_path)
    figures = summary(tmp_path)
    assert figures["steps"] == 6 and not any(name.startswith("test_") for name in figures)
    assert not any(name.startswith("test/") for row in metrics(tmp_path) for name in row)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_the_best_checkpoint_holds_the_best_value_logged_and_outlives_pruning(strategy):
    run_dir = best_runs()[strategy]
    losses = val_losses(run_dir)
    best_step = max(losses, key=losses.get)
    assert best_step == 2  # BEST's premise: not the last evaluation
    figures = summary(run_dir)
    assert (figures["monitor"], figures["best_step"]) == ("val/loss", best_step)
    assert figures["best_value"] == losses[best_step]

    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best", "step-000006"]
    best = checkpoints / "best"
    assert is_sharded(best) == (strategy == "fsdp")  # the run's format: fsdp's is DCP's
    assert load_checkpoint(best)["step"] == best_step
    evaluated = evaluate_checkpoint(run_dir, "val", best)
    assert evaluated[0] == pytest.approx(losses[best_step], rel=0, abs=1e-5)
    assert resume_path("auto", run_dir) == checkpoints / "step-000006"  # never the best


def test_early_stopping_ends_every_layout_at_the_same_step_and_tests_the_best_weights():
    runs = strategy_runs(*EARLY_STOP, strategies=("ddp", "pp"))
    for name, run_dir in runs.items():
        figures = summary(run_dir)
        assert (figures["stopped_early"], figures["steps"], figures["best_step"]) == (
            True,
            6,
            2,
        ), name
        assert max(row["step"] for row in metrics(run_dir)) == 6
        saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert saved == ["best", "step-000006"]
        assert load_checkpoint(run_dir / "checkpoints" / "step-000006")["stopped_early"]
        log = (run_dir / "train.log").read_text()
        reason = (
            f"stopping early: val/loss has not improved on its best, {figures['best_value']:.4g} "
            "at step 2, for 2 values (trainer.early_stop_patience=2)"
        )
        assert log.count(reason) == 1, name
        assert figures["test_step"] == 2
        best = evaluate_checkpoint(run_dir, "test", run_dir / "checkpoints" / "best")
        assert figures["test_loss"] == pytest.approx(best[0], rel=0, abs=1e-5), name
        assert figures["test_loss"] != pytest.approx(
            evaluate_checkpoint(run_dir, "test")[0], abs=1e-4
        )  # not the final weights'


def linear_writer(
    run_dir: Path, keep: int
) -> tuple[CheckpointWriter, torch.nn.Module, torch.optim.Optimizer]:
    """A writer of full checkpoints in this process, and a small model and optimizer to save."""
    writer = CheckpointWriter(run_dir, Strategy(ParallelConfig(), "cpu"), "full", keep, False)
    model = torch.nn.Linear(2, 2)
    return writer, model, torch.optim.SGD(model.parameters())


def bare_state(step: int) -> dict:
    return {"step": step, "rng": {}, "config": {}, "tracker_run_ids": {}}


def test_a_new_best_checkpoint_is_swapped_in_for_the_old_one(tmp_path):
    writer, model, optimizer = linear_writer(tmp_path, keep=1)
    for step in (1, 2):
        writer.save(model, optimizer, bare_state(step), best=True)
    assert load_checkpoint(best_dir(tmp_path))["step"] == 2
    assert [path.name for path in (tmp_path / "checkpoints").iterdir()] == ["best"]


def test_a_step_checkpoint_of_the_best_state_links_the_best_one_s_files(tmp_path):
    """At a step that is both the best and a checkpoint step, the state is written once: the
    step's checkpoint is best/'s files, hard-linked, and it stays whole and loadable when a later
    best replaces best/. (In this process, about 0.1 s.)"""
    writer, model, optimizer = linear_writer(tmp_path, keep=2)
    writer.save(model, optimizer, bare_state(2), best=True)
    writer.save(model, optimizer, bare_state(2))
    best, saved = best_dir(tmp_path), tmp_path / "checkpoints" / "step-000002"
    files = sorted(path.name for path in best.iterdir())
    assert sorted(path.name for path in saved.iterdir()) == files
    assert all((best / name).samefile(saved / name) for name in files)
    writer.save(model, optimizer, bare_state(3), best=True)
    assert resume_path("auto", tmp_path) == saved  # its manifest holds
    assert load_checkpoint(saved)["step"] == 2 and load_checkpoint(best)["step"] == 3
