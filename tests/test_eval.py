"""`python eval.py`: a checkpoint of any layout evaluated under another gives the figures the run
itself logged at its end; predictions come in dataset order whatever the layout; bad input is
one line and exit code 2; the W&B run joins the training run's group."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY,
    reference_run,
    run_eval,
    strict_json,
    summary,
    sweep_runs,
    wandb_records,
)
from test_mesh_checkpoints import saved_runs

from src.checkpoint.export import export
from src.checkpoint.store import saved_checkpoints

VAL = ("split=val",)


def trained(layout: str) -> Path:
    """TINY trained under `layout`: single's is the session's `reference_run(*TINY)`, which
    other files read too; ddp's and fsdp's come from one sweep."""
    if layout == "single":
        return reference_run(*TINY)
    return sweep_runs(*TINY, "parallel=ddp,fsdp")[f"parallel={layout}"]


def wandb_run() -> Path:
    """TINY under single, logged to W&B (offline) and checkpointed at steps 3 and 6: the run of
    the W&B test and of `best` and `last`."""
    with_wandb = [override for override in TINY if override != "logger=none"]
    return reference_run(*with_wandb, "logger=wandb", "trainer.checkpoint_every=3")


def eval_json(eval_dir: Path) -> dict:
    return strict_json((eval_dir / "eval.json").read_text())


@pytest.mark.equivalence
@pytest.mark.parametrize(
    "trained_as, evaluated_as",
    [
        ("single", ("parallel=ddp", "parallel.devices=2")),
        ("ddp", ("parallel=single",)),
        ("fsdp", ("parallel=single",)),  # sharded: read whole by one process
    ],
    ids=["single-as-ddp", "ddp-as-single", "fsdp-as-single"],
)
def test_a_checkpoint_evaluated_under_another_layout_gives_the_runs_test_loss(
    trained_as, evaluated_as, tmp_path
):
    """The test split (eval.py's default), which the run itself scored after its last step."""
    run_dir = trained(trained_as)
    result = run_eval(f"ckpt_path={run_dir}", *evaluated_as, eval_dir=tmp_path)
    assert "Warning" not in result.stdout + result.stderr  # DCP's read by one process, too

    figures = eval_json(tmp_path)
    newest = saved_checkpoints(run_dir)[-1]
    assert figures["checkpoint"] == str(newest) and figures["step"] == 6
    assert figures["split"] == "test" and figures["samples"] == 60
    assert figures["strategy"] == evaluated_as[0].removeprefix("parallel=")
    expected = summary(run_dir)
    assert abs(figures["loss"] - expected["test_loss"]) < 1e-5
    assert abs(figures["accuracy"] - expected["test_accuracy"]) < 1e-5


@pytest.mark.equivalence
@pytest.mark.timeout(600)
def test_a_2d_sharded_checkpoint_is_evaluated_by_ddp(tmp_path):
    """fsdp 2 x tp 2's shards, read whole by each of 2 replicas."""
    run_dir = saved_runs()["fsdp_tp"]
    run_eval(f"ckpt_path={run_dir}", "parallel=ddp", "parallel.devices=2", eval_dir=tmp_path)
    assert abs(eval_json(tmp_path)["loss"] - summary(run_dir)["test_loss"]) < 1e-5


def test_predictions_of_two_ranks_are_singles_in_dataset_order(tmp_path):
    run_dir = trained("single")
    layouts = {"single": ("parallel=single",), "ddp": ("parallel=ddp", "parallel.devices=2")}
    predictions = {}
    for name, layout in layouts.items():
        eval_dir = tmp_path / name
        run_eval(f"ckpt_path={run_dir}", *VAL, "predict=true", *layout, eval_dir=eval_dir)
        assert eval_json(eval_dir)["predictions"] == "predictions.pt"
        predictions[name] = torch.load(eval_dir / "predictions.pt", weights_only=True)
        assert not list(eval_dir.glob(".predictions-*")), "the ranks' own files are merged"

    single, ddp = predictions["single"], predictions["ddp"]
    assert torch.equal(single["indices"], torch.arange(60))
    assert torch.equal(ddp["indices"], single["indices"])
    assert single["outputs"].shape == (60, 10)
    torch.testing.assert_close(ddp["outputs"], single["outputs"], rtol=0, atol=1e-6)


def test_an_exported_safetensors_file_is_evaluated_with_the_model_it_names(tmp_path):
    """The file holds the model's config, not the data's: the data settings come from the
    command line (here TINY's)."""
    run_dir = trained("single")
    weights = tmp_path / "model.safetensors"
    export(run_dir, weights)
    data = [override for override in TINY if override.startswith("data.")]
    result = run_eval(
        f"ckpt_path={weights}", *data, "parallel=ddp", "parallel.devices=2", eval_dir=tmp_path
    )
    assert "test | exported weights | loss " in result.stdout  # no step to name
    figures = eval_json(tmp_path)
    assert figures["step"] is None and figures["checkpoint"] == str(weights)
    assert abs(figures["loss"] - summary(run_dir)["test_loss"]) < 1e-5


def test_best_and_last_name_the_checkpoints_of_run_dir(tmp_path):
    """`best` is checkpoints/best (trainer.monitor's), `last` the newest step-*."""
    run_dir = wandb_run()
    for name, step in (("best", summary(run_dir)["best_step"]), ("last", 6)):
        eval_dir = tmp_path / name
        run_eval(f"ckpt_path={name}", f"run_dir={run_dir}", *VAL, eval_dir=eval_dir)
        assert eval_json(eval_dir)["step"] == step


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("ckpt_path={staging}",), "is a checkpoint still being written, or one a crash left"),
        (("ckpt_path={no_files}",), "holds no checkpoint (checkpoint.pt, or .metadata with"),
        (
            ("ckpt_path={run}", "model.hidden=64", *VAL),
            "holds a different model (0.1.bias: [32] there",
        ),
        (("ckpt_path={run}", "split=holdout"), "split=holdout: the data has no such split; choose"),
        (("split=val",), "ckpt_path is required"),
    ],
    ids=["staging", "no-files", "other-model", "no-such-split", "no-ckpt-path"],
)
def test_bad_input_is_one_line_and_exit_code_2(overrides, message, tmp_path):
    run_dir = trained("single")
    staging = tmp_path / "checkpoints" / ".staging-step-000009"  # a checkpoint, unpublished
    shutil.copytree(saved_checkpoints(run_dir)[-1], staging)
    (tmp_path / "no-files").mkdir()
    folders = {"run": run_dir, "staging": staging, "no_files": tmp_path / "no-files"}
    filled = [override.format(**folders) for override in overrides]
    result = run_eval(*filled, eval_dir=tmp_path / "eval", check=False)

    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    (line,) = [line for line in output.splitlines() if message in line]
    assert "Traceback" not in output
    assert not (tmp_path / "eval" / "eval.json").exists()
    assert line.startswith("eval.py: error: ") or "[ERROR]" in line


def test_wandb_eval_run_has_job_type_eval_in_the_training_runs_group(tmp_path):
    """Offline W&B files, of the training run and of eval.py's run, read back."""
    run_dir, eval_dir = wandb_run(), tmp_path / "eval"
    run_eval(f"ckpt_path={run_dir}", *VAL, eval_dir=eval_dir)

    runs = {}
    for name, folder in (("train", run_dir), ("eval", eval_dir)):
        (runs[name],) = [
            r.run for r in wandb_records(folder) if r.WhichOneof("record_type") == "run"
        ]
    assert runs["train"].run_group == runs["eval"].run_group == str(run_dir)
    assert runs["eval"].job_type == "eval" and runs["eval"].display_name == "eval-val"
    summary_items = {
        item.key: json.loads(item.value_json)
        for r in wandb_records(eval_dir)
        if r.WhichOneof("record_type") == "summary"
        for item in r.summary.update
    }
    assert summary_items["loss"] == eval_json(eval_dir)["loss"]
