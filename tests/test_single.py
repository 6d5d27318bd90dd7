"""`parallel=single` through the real `train.py`: the reference for every other strategy."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    TINY,
    TINY_SGD,
    TINY_TRANSFORMER,
    assert_same_training,
    checkpoint,
    metrics,
    on_cpu,
    reference_run,
    run_train,
    summary,
    sweep_runs,
    train_losses,
)
from omegaconf import OmegaConf

from src.components.models import MLP, Transformer

SUMMARY_KEYS = {
    "strategy",
    "devices",
    "world_size",
    "global_batch",
    "matmul_precision",
    "steps",
    "final_train_loss",
    "final_train_accuracy",
    "final_val_loss",
    "val_accuracy",
    "samples_per_sec",
    "step_time_ms",
    "peak_memory_mb",
    "wall_time_s",
}


def test_the_default_run_learns_and_prints_its_overrides_progress_and_summary_only(tmp_path):
    """The README's first command: validation loss falls and accuracy beats chance; the full
    config goes to train.log only (and .hydra/), and W&B offline says one line."""
    result = run_train(run_dir=tmp_path, env={"WANDB_SILENT": "false"})

    printed = result.stdout + result.stderr
    assert len(printed.splitlines()) < 30, printed
    assert f"overrides: {' '.join(on_cpu([]))}\n" in printed
    assert "max_steps: 300" not in printed, "no config dump on the console"
    assert "step 300/300" in printed and "run summary" in printed
    log = (tmp_path / "train.log").read_text()
    assert "overrides: trainer.accelerator=cpu" in log and "step 300/300" in log
    assert "run summary" in log
    assert "config:" in log and "max_steps: 300" in log and "run_name: single-1" in log

    val_losses = [row["val/loss"] for row in metrics(tmp_path) if "val/loss" in row]
    assert len(val_losses) == 3 and val_losses[-1] < val_losses[0]
    assert summary(tmp_path)["val_accuracy"] > 0.5
    train_accuracy = [row["train/accuracy"] for row in metrics(tmp_path) if "train/loss" in row]
    assert train_accuracy[-1] > max(0.5, train_accuracy[0])
    assert summary(tmp_path)["final_train_accuracy"] == train_accuracy[-1]
    assert 0 < summary(tmp_path)["tensor_peak_mb"][0] < summary(tmp_path)["peak_memory_mb"][0]


def test_single_run_writes_summary_and_loadable_checkpoint():
    tmp_path = reference_run(*TINY)

    result = summary(tmp_path)
    assert result.keys() >= SUMMARY_KEYS
    assert result["strategy"] == "single" and result["world_size"] == 1
    assert result["steps"] == 6 and result["global_batch"] == 24
    assert result["matmul_precision"] == "highest"  # true fp32 on CPU unless asked otherwise
    assert len(result["peak_memory_mb"]) == 1 and result["samples_per_sec"] > 0
    assert result["tensor_peak_mb"] == [None]  # trainer.count_tensor_memory=false

    state = checkpoint(tmp_path)
    assert state["step"] == 6 and state["config"]["trainer"]["max_steps"] == 6
    model = MLP(input_shape=(32,), num_classes=10, hidden=32, depth=3)
    model.load_state_dict(state["model"])  # plain keys, no `module.` prefix
    assert [row["step"] for row in metrics(tmp_path) if "train/loss" in row] == list(range(1, 7))
    assert (tmp_path / "train.log").read_text().count("step 6/6") == 1
    # Pinned by the tests' runner: on a GPU machine `auto` would pick CUDA.
    assert OmegaConf.load(tmp_path / ".hydra" / "config.yaml").trainer.accelerator == "cpu"
    assert result["memory_devices"] == ["cpu:rank0"]


def test_a_run_within_its_timing_warm_up_writes_null_speeds_and_says_why(tmp_path):
    """4 steps, all warm-up: nothing timed. summary.json stays JSON (`summary` refuses NaN)."""
    overrides = [o for o in TINY if not o.startswith(("trainer.max_steps", "trainer.timing_"))]
    result = run_train(
        *overrides, "trainer.max_steps=4", "trainer.timing_warmup_steps=5", run_dir=tmp_path
    )
    figures = summary(tmp_path)
    speeds = ("samples_per_sec", "step_time_ms", "step_time_spread", "data_wait_ms")
    assert [figures[name] for name in (*speeds, "tflops_per_sec")] == [None] * 5
    assert figures["steps"] == 4 and figures["final_train_loss"] > 0
    assert (
        "no speed figures (samples_per_sec, step_time_ms and those from them are null in "
        "summary.json): the 4 step(s) trained here are all warm-up, which is not timed (the "
        "first 5: trainer.timing_warmup_steps)"
    ) in result.stdout + result.stderr


def test_tests_choose_the_cpu_unless_they_choose_the_accelerator():
    assert on_cpu(["parallel=ddp"]) == ["parallel=ddp", "trainer.accelerator=cpu"]
    assert on_cpu(["trainer.accelerator=cuda"]) == ["trainer.accelerator=cuda"]


def test_transformer_on_tokens_trains(tmp_path):
    run_train(*TINY_TRANSFORMER, run_dir=tmp_path)
    model = Transformer(input_shape=(8,), num_classes=16, hidden=32, depth=2, heads=2)
    model.load_state_dict(checkpoint(tmp_path)["model"])
    assert math.isfinite(summary(tmp_path)["final_val_loss"])


def test_same_seed_same_run_and_other_seed_differs():
    seeds = sweep_runs(*TINY, "seed=1,2")
    run_dirs = {"a": reference_run(*TINY, "seed=1"), "b": seeds["seed=1"], "c": seeds["seed=2"]}
    weights = {
        name: checkpoint(run_dir)["model"]["0.1.weight"] for name, run_dir in run_dirs.items()
    }
    assert torch.equal(weights["a"], weights["b"])
    assert not torch.equal(weights["a"], weights["c"])


@pytest.mark.equivalence
def test_accumulation_trains_the_same_global_batch(tmp_path):
    """Two micro-steps of 12 give the step that one batch of 24 gives."""
    run_train(*TINY_SGD, "trainer.accumulate=2", run_dir=tmp_path)
    assert_same_training(reference_run(*TINY_SGD), tmp_path)


def test_bf16_autocast_and_clipping_run(tmp_path):
    run_train(*TINY, "trainer.precision=bf16", "trainer.grad_clip=0.5", run_dir=tmp_path)
    losses = train_losses(tmp_path)
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
    assert "memory/cpu:rank0_peak_mb" in metrics(tmp_path)[0]
