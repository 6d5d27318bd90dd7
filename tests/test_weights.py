"""Weights outside the run: a checkpoint exported as `.safetensors` (tied weights stored once, the
model's config in the metadata) and read back whole by `load_weights`; `trainer.init_from`, a new
run from a checkpoint's or an export's weights, under any strategy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    ROOT,
    TINY,
    TINY_SGD,
    assert_same_training,
    checkpoint,
    metrics,
    reference_run,
    run_train,
    strategy_runs,
    summary,
    train_losses,
)
from hydra.utils import instantiate
from safetensors import safe_open

from src.checkpoint.export import load_weights, weights_config

GPT = (
    *(option for option in TINY if not option.startswith(("model.", "data."))),
    "model=gpt",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=16",
    "data=synthetic_tokens",
    "data.seq_len=8",
    "data.vocab_size=16",
    "data.num_samples=200",
    "task=language_model",
)
EMBEDDING, HEAD = "0.token.weight", "3.1.weight"  # GPT of 2 layers: the head ties to the embedding


def export(source: Path, target: Path, umask: int = -1) -> None:
    """`python -m src.checkpoint.store export <source> <target>`, as a user runs it (under
    `umask`; -1: this process's)."""
    command = [sys.executable, "-m", "src.checkpoint.store", "export", str(source), str(target)]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, check=True, umask=umask
    )
    assert f"wrote {target}" in result.stdout


def source_checkpoint() -> Path:
    """A finished TINY_SGD run's checkpoint: the weights the runs below start from."""
    return reference_run(*TINY_SGD) / "checkpoints" / "step-000006"


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_a_safetensors_export_round_trips_exactly_with_tied_weights_stored_once(
    tmp_path, checkpoint_format
):
    run_dir = reference_run(*GPT, f"trainer.checkpoint_format={checkpoint_format}")
    target = tmp_path / "model.safetensors"

    export(run_dir, target)

    saved = checkpoint(run_dir)["model"]
    with safe_open(str(target), framework="pt") as file:
        assert EMBEDDING in file.keys() and HEAD not in file.keys()  # noqa: SIM118
    weights = load_weights(target)
    assert list(weights) == list(saved)  # single's keys, in order, the tied one too
    assert all(torch.equal(weights[key], value) for key, value in saved.items())
    assert weights[HEAD] is weights[EMBEDDING]
    config = weights_config(target)
    assert config == weights_config(run_dir)
    assert config["model"]["_target_"] == "src.components.models.GPT"
    model = instantiate(
        config["model"], input_shape=config["input_shape"], num_classes=config["num_classes"]
    )
    model.load_state_dict(weights)  # strict
    assert model[-1][1].weight is model[0].token.weight  # still tied
    assert torch.equal(model[0].token.weight, saved[EMBEDDING])


def test_an_export_is_whole_and_readable_as_the_umask_allows(tmp_path):
    """A colleague on the cluster reads an export as they read the run's checkpoints: the mode
    a new file gets under the umask (here 0027: the group reads), never owner-only."""
    for name in ("model.safetensors", "model.pt"):
        export(source_checkpoint(), tmp_path / name, umask=0o027)
        assert oct((tmp_path / name).stat().st_mode & 0o777) == oct(0o640), name
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.pt", "model.safetensors"]


def test_a_run_from_a_checkpoint_s_weights_trains_alike_under_single_and_ddp():
    """A new run (step 1 onwards, a fresh optimizer) from another run's final weights: ddp on
    2 processes trains single's losses and weights."""
    runs = strategy_runs(*TINY_SGD, f"trainer.init_from={source_checkpoint()}", strategies=("ddp",))
    assert_same_training(runs["single"], runs["ddp"])
    fine_tuned = runs["single"]
    assert metrics(fine_tuned)[0]["step"] == 1 and checkpoint(fine_tuned)["step"] == 6
    # The same first batch as the source run's (same seed), on its trained weights.
    assert train_losses(fine_tuned)[0] < train_losses(reference_run(*TINY_SGD))[0] - 0.01


def test_a_run_from_a_safetensors_export_trains_as_from_the_checkpoint(tmp_path):
    weights = tmp_path / "model.safetensors"
    export(source_checkpoint(), weights)
    run_dir = tmp_path / "run"

    result = run_train(*TINY_SGD, f"trainer.init_from={weights}", run_dir=run_dir)

    assert f"trainer.init_from: starting from the weights of {weights}" in result.stdout
    from_checkpoint = reference_run(*TINY_SGD, f"trainer.init_from={source_checkpoint()}")
    assert_same_training(from_checkpoint, run_dir)


def test_init_strict_false_lists_the_keys_that_do_not_fit_and_trains(tmp_path):
    """One hidden block more than the checkpoint's model: its last block and head are new."""
    source = source_checkpoint()
    result = run_train(
        *TINY_SGD,
        "model.depth=4",
        "trainer.init_strict=false",
        f"trainer.init_from={source}",
        run_dir=tmp_path,
    )
    assert (
        f"4 keys of the model are not in {source} and keep their initialisation: 3.0.weight, "
        "3.0.bias, 4.weight, 4.bias" in result.stdout
    )
    assert f"2 keys of {source} are not in the model and are left out: 3.weight, 3.bias" in (
        result.stdout
    )
    assert summary(tmp_path)["steps"] == 6


def test_a_checkpoint_to_resume_wins_over_init_from(tmp_path):
    """resume=auto with init_from: the first run starts from init_from's weights; the same
    command after a kill resumes its own checkpoint (a resumed fine-tune continues)."""
    command = (
        *TINY_SGD,
        "trainer.checkpoint_every=3",
        "trainer.resume=auto",
        f"trainer.init_from={source_checkpoint()}",
    )
    finished = tmp_path / "finished"
    first = run_train(*command, run_dir=finished)
    assert "starting from the weights of" in first.stdout
    killed = tmp_path / "killed"  # as if killed after step 3's checkpoint
    shutil.copytree(finished, killed)
    shutil.rmtree(killed / "checkpoints" / "step-000006")
    (killed / "summary.json").unlink()

    resumed = run_train(*command, run_dir=killed)

    assert f"resuming from {killed}/checkpoints/step-000003 at step 3" in resumed.stdout
    assert "starting from the weights of" not in resumed.stdout
    assert_same_training(finished, killed)
