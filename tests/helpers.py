"""Run `train.py` for real and read back what a run wrote."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

# A few seconds per run on 2 CPU cores: small model, few steps, every step logged.
TINY = (
    "trainer.max_steps=6",
    "trainer.batch_size=24",
    "trainer.log_every=1",
    "trainer.eval_every=3",
    "trainer.timing_warmup_steps=1",
    "data.num_samples=600",
    "model.hidden=32",
    "model.depth=3",
    "logger=none",
)
TINY_TRANSFORMER = (
    *TINY,
    "model=transformer",
    "data=synthetic_tokens",
    "data.seq_len=8",
    "data.vocab_size=16",
    "model.depth=2",
    "model.heads=2",
)


def run_train(
    *overrides: str,
    run_dir: Path,
    check: bool = True,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`python train.py <overrides> hydra.run.dir=<run_dir>` in a subprocess."""
    command = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
    result = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "WANDB_SILENT": "true", **(env or {})},
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
        )
    return result


@functools.cache
def reference_run(*overrides: str) -> Path:
    """A `parallel=single` run with these overrides, trained once per test session."""
    run_dir = Path(tempfile.mkdtemp(prefix="reference-"))
    run_train(*overrides, "parallel=single", run_dir=run_dir)
    return run_dir


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def train_losses(run_dir: Path) -> list[float]:
    return [row["train/loss"] for row in metrics(run_dir) if "train/loss" in row]


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def checkpoint(run_dir: Path) -> dict[str, Any]:
    return torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)


def assert_same_training(reference: Path, other: Path, atol: float = 1e-5) -> None:
    """Same per-step losses and final weights (max abs difference below `atol`)."""
    expected, actual = train_losses(reference), train_losses(other)
    assert len(actual) == len(expected)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=0, atol=atol)
    expected_weights, actual_weights = checkpoint(reference)["model"], checkpoint(other)["model"]
    assert actual_weights.keys() == expected_weights.keys()
    for key, weight in expected_weights.items():
        difference = (actual_weights[key].float() - weight.float()).abs().max().item()
        assert difference < atol, f"{key}: max abs difference {difference:.2e}"
