"""Checkpoint layout and formats: step folders, keep-last-K with fallback, requeue of a finished
run, export, sharded (DCP) checkpoints resumed on other process counts and strategies, async,
fp16's loss scale."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import (
    ROOT,
    TINY,
    assert_same_training,
    checkpoint,
    reference_run,
    run_train,
    summary,
)

from src.checkpoint.store import load_checkpoint
from src.components.models import MLP

# SGD (weights move every step; see test_fsdp.py), a checkpoint at step 3 of 6.
SGD = (*TINY, "optimizer=sgd", "optimizer.warmup_steps=0", "trainer.checkpoint_every=3")
FSDP2 = ("parallel=fsdp", "parallel.devices=2")
FSDP3 = ("parallel=fsdp", "parallel.devices=3")
DDP2 = ("parallel=ddp", "parallel.devices=2")


def step_names(run_dir: Path) -> list[str]:
    """The run's step checkpoints (not `best/`, see test_after_training.py)."""
    folders = (run_dir / "checkpoints").iterdir()
    return sorted(path.name for path in folders if path.name.startswith("step-"))


@functools.cache
def finished_run(*overrides: str) -> Path:
    """A run of SGD with these overrides, trained once per session (copy it before changing)."""
    run_dir = Path(tempfile.mkdtemp(prefix="ckpt-source-"))
    run_train(*SGD, *overrides, run_dir=run_dir)
    return run_dir


def from_step_3(source: Path, tmp_path: Path) -> Path:
    """A copy of `source` as it was when killed after step 3's checkpoint."""
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-000006")
    (run_dir / "summary.json").unlink()
    return run_dir


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "written_by, resumed_by",
    [
        (FSDP2, FSDP3),
        (FSDP3, ("parallel=fsdp", "parallel.devices=1")),
        (FSDP2, DDP2),
        (FSDP2, ("parallel=single",)),
        (FSDP2, ("parallel=model_parallel",)),  # reads it whole, in single's format
    ],
    ids=["fsdp2-fsdp3", "fsdp3-fsdp1", "fsdp2-ddp2", "fsdp2-single", "fsdp2-model_parallel"],
)
def test_a_sharded_checkpoint_resumes_on_other_ranks_and_strategies(
    tmp_path, written_by, resumed_by
):
    """fsdp writes sharded checkpoints by default; each rank wrote its own shards. Resumed by
    another number of ranks or another strategy, the run ends as an uninterrupted single run."""
    source = finished_run(*written_by)
    ranks = int(written_by[1].split("=")[1])
    written = source / "checkpoints" / "step-000003"
    assert len(list(written.glob("*.distcp"))) == ranks and (written / ".metadata").is_file()
    run_dir = from_step_3(source, tmp_path)

    result = run_train(*SGD, *resumed_by, "trainer.resume=auto", run_dir=run_dir)

    assert f"resuming from {run_dir}/checkpoints/step-000003 at step 3" in result.stdout
    assert_same_training(reference_run(*SGD), run_dir)


@pytest.mark.timeout(300)
def test_keeps_the_last_k_and_falls_back_past_a_damaged_one(tmp_path):
    source = finished_run("trainer.checkpoint_every=1", "trainer.keep_checkpoints=2", *FSDP2)
    assert step_names(source) == ["step-000005", "step-000006"]
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    (run_dir / "summary.json").unlink()
    newest = run_dir / "checkpoints" / "step-000006"
    shard = newest / "__1_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])  # damaged on disk

    result = run_train(*SGD, *FSDP2, "trainer.resume=auto", run_dir=run_dir)

    damaged = f"{newest} is corrupt: __1_0.distcp is 100 bytes, {size} when written"
    assert f"{damaged}; resuming from the checkpoint before" in result.stdout
    assert "at step 5" in result.stdout
    assert_same_training(reference_run(*SGD), run_dir)
    assert step_names(run_dir) == ["step-000005", "step-000006"]  # 6 written again, intact


def test_a_requeued_run_that_had_finished_ends_successfully(tmp_path):
    """Killed after its final checkpoint (before summary.json), the same command ends at once,
    exit 0, and writes the summary; an explicit checkpoint path is still refused (bad input)."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run(*SGD), run_dir)
    (run_dir / "summary.json").unlink()
    weights = checkpoint(run_dir)["model"]

    result = run_train(*SGD, "trainer.resume=auto", run_dir=run_dir)

    assert "step-000006 is at step 6 of trainer.max_steps=6: this run is complete" in result.stdout
    finished = summary(run_dir)
    assert finished["steps"] == 6 and finished["completed_before_resume"] is True
    assert finished["final_val_loss"] == summary(reference_run(*SGD))["final_val_loss"]
    assert all(torch.equal(weights[k], v) for k, v in checkpoint(run_dir)["model"].items())


def test_export_writes_single_s_plain_state_dict_from_a_sharded_checkpoint(tmp_path):
    target = tmp_path / "model.pt"
    exported = subprocess.run(
        [
            sys.executable,
            "-m",
            "src.checkpoint.store",
            "export",
            str(finished_run(*FSDP2)),
            str(target),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"wrote {target}" in exported.stdout
    state = torch.load(target, weights_only=True)
    MLP(input_shape=(32,), num_classes=10, hidden=32, depth=3).load_state_dict(state)  # strict
    reference = checkpoint(reference_run(*SGD))["model"]
    assert all((state[k] - v).abs().max() < 1e-5 for k, v in reference.items())


@pytest.mark.timeout(300)
def test_async_sharded_checkpoints_resume_exactly(tmp_path):
    """DCP's async save copies the state before training changes it in place."""
    source = finished_run(*FSDP2, "trainer.async_checkpoint=true")
    assert summary(source)["checkpoint_blocked_s"] > 0
    run_dir = from_step_3(source, tmp_path)
    run_train(*SGD, "parallel=single", "trainer.resume=auto", run_dir=run_dir)
    assert_same_training(reference_run(*SGD), run_dir)


@pytest.mark.parametrize("strategy", [("parallel=single",), DDP2], ids=["single", "ddp"])
def test_single_and_ddp_write_sharded_checkpoints_on_request(strategy):
    source = finished_run(*strategy, "trainer.checkpoint_format=sharded")
    assert (source / "checkpoints" / "step-000006" / ".metadata").is_file()
    state = checkpoint(source)
    assert sorted(state["optimizer"]["state"]) == list(range(8))  # read back in single's format
    assert json.loads((source / "summary.json").read_text())["steps"] == 6
    assert_same_training(reference_run(*SGD), source)


def test_a_resumed_fp16_run_goes_on_at_the_loss_scale_it_reached(tmp_path):
    """A first scale of 1e6 overflows the first steps' fp16 gradients: by step 3's checkpoint
    the scaler has skipped 3 steps, halving its scale each time. Resumed there, the run goes on
    at that scale (from 1e6 again it would skip steps 4 to 6 too) and ends exactly as the
    uninterrupted run, skipped steps counted alike."""
    fp16 = ("trainer.precision=fp16", "trainer.loss_scale_init=1e6")
    source = finished_run(*fp16)
    saved = load_checkpoint(source / "checkpoints" / "step-000003")["loss_scaling"]
    assert saved["skipped_steps"] == 3 and saved["scaler"]["scale"] == 1.25e5
    run_dir = from_step_3(source, tmp_path)

    run_train(*SGD, *fp16, "trainer.resume=auto", run_dir=run_dir)

    assert_same_training(source, run_dir)
    assert summary(run_dir)["scaler_skipped_steps"] == summary(source)["scaler_skipped_steps"]
