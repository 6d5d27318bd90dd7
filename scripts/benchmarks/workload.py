"""The workload the comparisons share, the device they run on, and the timing of the
template's `train` and of hand-written loops."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from src.training.build import check_config
from src.training.trainer import train

ROOT = Path(__file__).resolve().parents[2]  # the repository: conf/, train.py
WARMUP_STEPS = 20
BATCH_SIZE = 256
DEVICE = "cpu"  # set from --device by scripts/benchmark.py
WORKLOAD = (
    "model=mlp",
    "model.hidden=512",
    "model.depth=4",
    "data=synthetic",
    "data.input_dim=128",
    "data.num_samples=32768",
    f"trainer.batch_size={BATCH_SIZE}",
    "optimizer=adamw",
    "optimizer.schedule=constant",
    "optimizer.warmup_steps=0",
    "logger=none",
)
OVERHEAD_BATCH_SIZE = 16
# Tiny overrides on top of WORKLOAD: a step is then almost only the host's work.
OVERHEAD_WORKLOAD = (
    "model.hidden=16",
    "model.depth=1",
    "data.input_dim=16",
    "data.num_samples=4096",
    f"trainer.batch_size={OVERHEAD_BATCH_SIZE}",
)


def compose_config(*overrides: str) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def template_speed(steps: int, *overrides: str, workload: tuple[str, ...] = WORKLOAD) -> float:
    """samples/s of the workload with these overrides through the template's own `train`."""
    cfg = compose_config(
        *workload,
        f"trainer.accelerator={DEVICE}",
        *overrides,
        f"trainer.max_steps={steps}",
        f"trainer.timing_warmup_steps={WARMUP_STEPS}",
        "trainer.log_every=50",
        "trainer.eval_every=0",
    )
    with tempfile.TemporaryDirectory() as run_dir:
        return train(cfg, Path(run_dir), check_config(cfg, Path(run_dir)))["samples_per_sec"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Over the classes of every sample, or of every token of a sequence."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


# SGD at a constant rate from the first step: the workloads compared with a plain SGD loop.
SGD_CONSTANT = ("optimizer=sgd", "optimizer.schedule=constant", "optimizer.warmup_steps=0")


def timed_steps(
    steps: int,
    batch_size: int,
    loss_of_step: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> float:
    """samples/s of a hand-written loop's steps after the warm-up: each backpropagates the loss
    `loss_of_step` returns and steps the optimizer; the loss is read every 50 steps."""
    for step in range(steps):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        loss = loss_of_step()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            loss.item()
    loss.item()  # wait for the queued steps
    return (steps - WARMUP_STEPS) * batch_size / (time.perf_counter() - started)
