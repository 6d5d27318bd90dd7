"""What the progress reporter (`src/runtime/progress.py`) costs on the default experiment."""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import workload
from benchmarks.workload import compose_config
from src.components.data import build_data
from src.config.base import typed
from src.config.trainer import TrainerConfig
from src.runtime.progress import PhaseProgress
from src.training.build import check_config
from src.training.trainer import train

ADVANCES = 1_000_000  # timed calls of `PhaseProgress.advance`


def default_run_s(steps: int, progress_every_s: str) -> tuple[float, float]:
    """Wall seconds of the default experiment's `train` (evaluation and checkpoints included)
    and its steady step time in ms, with trainer.progress_every_s as given (null: no progress)."""
    cfg = compose_config(
        "logger=none",
        f"trainer.accelerator={workload.DEVICE}",
        f"trainer.max_steps={steps}",
        f"trainer.progress_every_s={progress_every_s}",
    )
    with tempfile.TemporaryDirectory() as run_dir:
        strategy = check_config(cfg, Path(run_dir))
        started = time.perf_counter()
        summary = train(cfg, Path(run_dir), strategy)
        return time.perf_counter() - started, summary["step_time_ms"]


def advance_ns() -> float:
    """ns per `advance` of a phase that is not due to show anything (the hot path)."""
    progress = PhaseProgress("timed", ADVANCES)
    started = time.perf_counter()
    for _ in range(ADVANCES):
        progress.advance()
    return 1e9 * (time.perf_counter() - started) / ADVANCES


def progress_cost(rounds: int, steps: int) -> None:
    """The default experiment's wall time with progress (trainer.progress_every_s=2) over
    without (null), in alternating rounds; and the reporter's own cost per training step:
    an `advance` per evaluation batch, against the step time."""
    seconds: dict[str, list[float]] = {"2": [], "null": []}
    step_ms: list[float] = []
    for round_index in range(rounds):
        for every in ("2", "null") if round_index % 2 == 0 else ("null", "2"):
            wall_s, ms = default_run_s(steps, every)
            seconds[every].append(wall_s)
            step_ms.append(ms)
    ratios = [a / b for a, b in zip(seconds["2"], seconds["null"], strict=True)]
    cfg = typed(TrainerConfig, compose_config().trainer)
    data = build_data(compose_config().data, 0)
    eval_batches = math.ceil(len(data.val) / cfg.eval_batch)
    per_step_ns = advance_ns() * eval_batches / cfg.eval_every
    median_ms = statistics.median(step_ms)
    print(
        f"{'progress':<16}  default experiment, {steps} steps: wall time with / without "
        f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}); the "
        f"reporter's work per step {per_step_ns:.0f} ns ({eval_batches} eval batches every "
        f"{cfg.eval_every} steps) = {per_step_ns / 1e4 / median_ms:.2g}% of the "
        f"{median_ms:.2f} ms step"
    )
