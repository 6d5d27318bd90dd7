"""`trainer.ema_decay`: every strategy's weight average is single's, a run resumed under another
layout goes on with the same average, and `trainer.ema_eval` scores it: in the run's evaluation
and test pass, in `eval.py` and in the export. All on cached sweeps that average with decay 0.5
and checkpoint at steps 3 and 6: tests/test_batches.py's over the strategies (`DICTS`), and
tests/test_gpt_options.py's GPT under ddp and tp (`NANOGPT`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    BESIDES_SINGLE,
    TINY,
    assert_goes_on_exactly,
    checkpoint,
    evaluate_checkpoint,
    run_eval,
    run_train,
    strategy_runs,
    strict_json,
    summary,
)
from test_batches import DICTS
from test_gpt_options import NANOGPT, WITHOUT_BIASES

from src.checkpoint.export import averaged_weights, export
from src.checkpoint.store import saved_checkpoints


def averaging_runs(strategy: str) -> dict[str, Path]:
    """The cached runs of `single` and `strategy` that average: tests/test_batches.py's for
    the strategies it sweeps, a GPT's for tp (tests/test_gpt_options.py)."""
    if strategy == "tp":
        return strategy_runs(*NANOGPT, strategies=WITHOUT_BIASES)
    return strategy_runs(*DICTS)


def averages(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weight average of the run's newest checkpoint, by parameter key."""
    state = checkpoint(run_dir)
    keys = state["parameter_keys"]
    return {keys[index]: entry["ema"] for index, entry in state["ema"]["state"].items()}


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", [*BESIDES_SINGLE, "tp"])
def test_each_strategys_weight_average_is_singles(strategy):
    runs = averaging_runs(strategy)
    expected, actual = averages(runs["single"]), averages(runs[strategy])
    assert list(actual) == list(expected)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    weights = checkpoint(runs["single"])["model"]
    assert max((expected[key] - weights[key]).abs().max().item() for key in expected) > 1e-3


@pytest.mark.equivalence
def test_a_run_resumed_under_another_layout_goes_on_with_the_same_average(tmp_path):
    """single resumes tp's step-3 checkpoint (sharded: the average's DTensor shards, read whole)
    and ends at the uninterrupted run's weights and average."""
    runs = averaging_runs("tp")
    step_3 = saved_checkpoints(runs["tp"])[0]
    assert step_3.name == "step-000003"
    run_train(*NANOGPT, "parallel=single", f"trainer.resume={step_3}", run_dir=tmp_path)
    assert_goes_on_exactly(runs["single"], tmp_path, [4, 5, 6])
    torch.testing.assert_close(averages(tmp_path), averages(runs["single"]), rtol=0, atol=1e-5)


@pytest.mark.equivalence
def test_eval_py_and_the_export_take_the_weight_average(tmp_path):
    """fsdp's sharded checkpoint, evaluated by one process under the run's trainer.ema_eval:
    the score of its average evaluated here, and the run's own test pass's; not its weights'."""
    run_dir = strategy_runs(*DICTS)["fsdp"]
    run_eval(f"ckpt_path={run_dir}", eval_dir=tmp_path)
    loss = strict_json((tmp_path / "eval.json").read_text())["loss"]
    assert abs(loss - evaluate_checkpoint(run_dir, "test", averaged=True)[0]) < 1e-5
    assert abs(loss - summary(run_dir)["test_loss"]) < 1e-5
    assert abs(loss - evaluate_checkpoint(run_dir, "test")[0]) > 1e-4

    export(run_dir, tmp_path / "exported.pt")
    exported = torch.load(tmp_path / "exported.pt", weights_only=True)
    torch.testing.assert_close(exported, averaged_weights(checkpoint(run_dir)), rtol=0, atol=0)


def test_an_early_stop_tests_the_average_of_the_best_step(tmp_path):
    """The test pass scores the best checkpoint's average (kept in memory), not the one of the
    step it stopped at."""
    overrides = ("trainer.max_steps=12", "trainer.eval_every=1", "trainer.early_stop_patience=1")
    averaged = ("trainer.ema_decay=0.5", "trainer.ema_eval=true", "optimizer.lr=0.2")
    run_train(*TINY, *overrides, *averaged, run_dir=tmp_path)
    figures = summary(tmp_path)
    assert figures["stopped_early"] and figures["test_step"] < figures["steps"]
    best = tmp_path / "checkpoints" / "best"
    best_average = evaluate_checkpoint(tmp_path, "test", best, averaged=True)[0]
    last_average = evaluate_checkpoint(tmp_path, "test", averaged=True)[0]
    assert abs(figures["test_loss"] - best_average) < 1e-5
    assert abs(figures["test_loss"] - last_average) > 1e-4
