"""Faults during training: a diverging loss stops the run (or its steps are skipped), and W&B
failing never stops training."""

from __future__ import annotations

import json
import socket

import torch
from helpers import TINY, checkpoint, run_train, summary, train_losses

# SGD at lr=1000 blows the loss up to NaN at step 4 (deterministically, from the seed).
DIVERGING = (
    *TINY,
    "optimizer=sgd",
    "optimizer.lr=1000",
    "optimizer.warmup_steps=0",
    "trainer.checkpoint_every=2",
)


def test_non_finite_loss_stops_the_run_naming_the_step(tmp_path):
    result = run_train(*DIVERGING, run_dir=tmp_path, check=False)

    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert (
        "the training loss became non-finite at step 4; stopped, and the last checkpoint "
        "(step 2) is kept" in output
    )
    assert "trainer.skip_nonfinite=true" in output and "Traceback" not in output
    assert not (tmp_path / "summary.json").exists()
    state = checkpoint(tmp_path)
    assert state["step"] == 2
    assert all(weight.isfinite().all() for weight in state["model"].values())
    assert all(torch.isfinite(torch.tensor(train_losses(tmp_path))))  # no NaN was logged


def test_skip_nonfinite_skips_those_steps_and_finishes(tmp_path):
    result = run_train(*DIVERGING, "trainer.skip_nonfinite=true", run_dir=tmp_path)

    assert "step 4: non-finite loss, optimizer step skipped" in result.stdout
    assert summary(tmp_path)["skipped_steps"] == 3  # steps 4, 5 and 6
    state = checkpoint(tmp_path)
    assert state["step"] == 6
    assert all(weight.isfinite().all() for weight in state["model"].values())


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_unreachable_wandb_server_does_not_stop_training(tmp_path):
    overrides = [o for o in TINY if o != "logger=none"]
    result = run_train(
        *overrides,
        "logger=wandb",
        "logger.mode=online",
        "logger.init_timeout_s=2",
        run_dir=tmp_path,
        env={
            "WANDB_MODE": "online",
            "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}",  # the only address contacted
            "WANDB_API_KEY": "0" * 40,
            "WANDB_ERROR_REPORTING": "false",  # no crash reports sent elsewhere
            "WANDB__DISABLE_UPDATE_CHECK": "true",  # no version check against PyPI
            "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        },
    )

    assert "W&B could not start" in result.stdout
    assert "training continues without tracking" in result.stdout
    assert summary(tmp_path)["steps"] == 6
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 6
