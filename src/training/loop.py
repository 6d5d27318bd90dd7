"""The parts of the training loop (`Trainer.train`, `trainer.py`) that each decide when they
are due: progress (and the throughput it reports), evaluation, checkpointing; the best checkpoint
and early stopping are `monitoring.py`'s, a step's work `step.py`'s.

Nothing here waits on the devices except on logging, eval and checkpoint steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from src.checkpoint.writer import CheckpointWriter
from src.components.batch_order import ValBatches
from src.components.tasks import Task
from src.config.trainer import TrainerConfig
from src.observe.report import rate_text
from src.observe.tracking import Trackers
from src.parallel.base import TrainingStrategy
from src.parallel.devices import process_peak_memory_mb
from src.runtime.files import json_text, write_atomically
from src.runtime.progress import bar_line
from src.training.step import evaluate, reduced_figures

log = logging.getLogger(__name__)


class Throughput:
    """Steady-state speed, from the logging windows after warm-up.

    A window's time runs from the end of the previous logging step's bookkeeping to the
    synchronization at its own logging step: warm-up steps, logging, eval and checkpoints are
    left out, and with them the one-time costs their first calls pay (in the first job of an
    in-process sweep, W&B's first log, say). Step time is the median over the windows, so that a
    window disturbed by something else on the machine does not count; `step_time_spread`
    ((slowest - fastest) / median) says how much the windows disagree. `data_wait_ms` is the
    mean time per step after warm-up that the loop waited for input (a loader's workers start
    in the first step)."""

    def __init__(
        self, warmup_steps: int, samples_per_step: int, tokens_per_sample: int | None = None
    ):
        self.warmup_steps = warmup_steps
        self.samples_per_step = samples_per_step
        self.tokens_per_sample = tokens_per_sample  # None: the samples are not token sequences
        self.steps_done = 0  # by this process: a resumed run warms up again
        now = time.perf_counter()
        self.started = now
        self.window_start, self.window_steps = now, 0  # the logging window, for progress lines
        self.timed_start = now if warmup_steps == 0 else None  # its part after warm-up
        self.timed_steps = 0
        self.window_ms: list[float] = []  # ms per step of each window's timed part
        self.window_wait_s = 0.0  # input waited for in the logging window
        self.timed_wait_s, self.all_timed_steps = 0.0, 0  # ... and in all steps after warm-up

    def step_done(self, strategy: TrainingStrategy, data_wait_s: float = 0.0) -> None:
        """A step is done, of which `data_wait_s` went on waiting for its input."""
        self.steps_done += 1
        self.window_steps += 1
        self.window_wait_s += data_wait_s
        if self.timed_start is not None:
            self.timed_steps += 1
            self.all_timed_steps += 1
            self.timed_wait_s += data_wait_s
        elif self.steps_done == self.warmup_steps:
            strategy.synchronize()
            self.timed_start = time.perf_counter()

    def window_data_wait_ms(self) -> float:
        """Input waited for per step in the logging window (before `close_window`)."""
        return 1000 * self.window_wait_s / self.window_steps

    def close_window(self) -> float:
        """End a logging window (the caller has synchronized); returns its ms per step."""
        self.window_wait_s = 0.0
        now = time.perf_counter()
        ms = 1000 * (now - self.window_start) / self.window_steps
        if self.timed_steps:
            self.window_ms.append(1000 * (now - self.timed_start) / self.timed_steps)
            self.timed_start, self.timed_steps = now, 0
        self.window_start, self.window_steps = now, 0
        return ms

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (logging, eval, checkpoints) counts in no step."""
        paused_at = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - paused_at
            self.window_start += elapsed
            if self.timed_start is not None:
                self.timed_start += elapsed

    def rates(self, step_ms: float) -> dict[str, float]:
        """samples_per_sec at `step_ms` per step, and tokens_per_sec for token sequences."""
        samples_per_sec = self.samples_per_step * 1000 / step_ms
        if self.tokens_per_sample is None:
            return {"samples_per_sec": samples_per_sec}
        return {
            "samples_per_sec": samples_per_sec,
            "tokens_per_sec": samples_per_sec * self.tokens_per_sample,
        }

    def untimed(self) -> str | None:
        """Why the speed figures are missing (null in summary.json), or None when they are not:
        a run of no more steps than the warm-up times none."""
        if self.window_ms:
            return None
        return (
            f"no speed figures (samples_per_sec, step_time_ms and those from them are null in "
            f"summary.json): the {self.steps_done} step(s) trained here are all warm-up, which "
            f"is not timed (the first {self.warmup_steps}: trainer.timing_warmup_steps); train "
            "more steps, or lower trainer.timing_warmup_steps"
        )

    def summary(self) -> dict[str, float]:
        if not self.window_ms:
            nan = float("nan")
            return {
                **self.rates(nan),
                "step_time_ms": nan,
                "step_time_spread": nan,
                "data_wait_ms": nan,
            }
        step_ms = statistics.median(self.window_ms)
        return {
            **self.rates(step_ms),
            "step_time_ms": step_ms,
            "step_time_spread": (max(self.window_ms) - min(self.window_ms)) / step_ms,
            "data_wait_ms": 1000 * self.timed_wait_s / self.all_timed_steps,
        }


def summary_val_figures(figures: dict[str, float]) -> dict[str, float]:
    """The last evaluation's figures as summary keys: `final_val_loss`, then `val_<name>` (the
    headline figures: `val_accuracy`, `val_perplexity`, ...)."""
    return {
        ("final_val_loss" if name == "loss" else f"val_{name}"): v for name, v in figures.items()
    }


def progress_line(
    step: int,
    max_steps: int,
    loss: float,
    rates: dict[str, float],
    data_wait_ms: float,
    eta_s: float,
) -> str:
    """The console's line for a logging step; `rates` is `Throughput.rates`' (samples/s, and
    tokens/s for token sequences)."""
    speeds = [f"{rate_text(rates['samples_per_sec'])} samples/s"]
    if "tokens_per_sec" in rates:
        speeds.append(f"{rate_text(rates['tokens_per_sec'])} tokens/s")
    details = (f"loss {loss:.4f}", *speeds, f"data wait {data_wait_ms:.1f} ms")
    return bar_line(f"step {step}/{max_steps}", step, max_steps, details, eta_s)


@contextlib.contextmanager
def open_history(
    tracker: Trackers, path: Path, start_step: int, is_main: bool
) -> Iterator[History]:
    """The run's `History`: the tracker, and `metrics.jsonl` (main process only) opened to append
    the rows after `start_step`.

    Rows past `start_step` come from a run that died after its last checkpoint (or an earlier run
    in this folder); they are dropped first, so the file reads as one uninterrupted run."""
    if not is_main:
        yield History(tracker, None)
        return
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if history_step(line) <= start_step]
        text = "".join(f"{line}\n" for line in kept)
        write_atomically(path, lambda staging: staging.write_text(text))
    with path.open("a") as file:
        yield History(tracker, file)


def history_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError):  # a line cut short by a crash
        return math.inf


def window_means(
    strategy: TrainingStrategy,
    task: Task,
    step_sums: list[torch.Tensor],
    targets: int | torch.Tensor,
) -> dict[str, float]:
    """The task's training figures over the targets of the steps since the last log (their
    `forward_backward` sums), over all processes; {} when every step of the window was skipped
    (see trainer.skip_nonfinite). Summed here, not per step: one device op per step saved."""
    if not step_sums:
        return {}
    return reduced_figures(strategy, task, torch.stack(step_sums).sum(0), targets)


def due(every: int, step: int) -> bool:
    """Whether a cadence of `every` steps (0: never) falls on `step`."""
    return every > 0 and step % every == 0


class History:
    """Where figures go: the tracker, and `metrics.jsonl` (main process only, see
    `open_history`)."""

    def __init__(self, tracker: Trackers, file: TextIO | None):
        self.tracker, self.file = tracker, file

    def record(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log(metrics, step=step)
        if self.file:
            self.file.write(json_text({"step": step, **metrics}) + "\n")
            self.file.flush()


class Progress:
    """The training figures, every `trainer.log_every` steps and at the last: summed over the
    steps since the previous log, recorded, and shown as a progress line."""

    def __init__(
        self, trainer: TrainerConfig, strategy: TrainingStrategy, task: Task, speed: Throughput
    ):
        self.trainer, self.strategy, self.task, self.speed = trainer, strategy, task, speed
        self.window_sums: list[torch.Tensor] = []  # each step's sums since the last log
        self.targets = 0
        self.figures: dict[str, float] = {"loss": math.nan}
        self.logged_step: int | None = None

    def due(self, step: int) -> bool:
        return due(self.trainer.log_every, step)

    def add(self, step_sums: torch.Tensor, targets: int | torch.Tensor) -> None:
        self.window_sums.append(step_sums)
        self.targets += targets

    def maybe_log(self, step: int, lr: float, history: History, force: bool) -> dict[str, float]:
        """The metrics recorded at `step` ({} when not due, or logged at this step already)."""
        if not (force or self.due(step)) or step == self.logged_step:
            return {}
        self.logged_step = step
        figures = window_means(self.strategy, self.task, self.window_sums, self.targets)
        self.figures = figures or {name: math.nan for name in self.figures}
        self.window_sums, self.targets = [], 0
        data_wait_ms = self.speed.window_data_wait_ms()
        step_ms = self.speed.close_window()
        rates = self.speed.rates(step_ms)
        with self.speed.paused():
            labels, (megabytes,) = self.strategy.local_peak_memory_mb(process_peak_memory_mb)
            memory = dict(zip(labels, megabytes, strict=True))
            metrics = {
                **{f"memory/{device}_peak_mb": mb for device, mb in memory.items()},
                **{f"train/{name}": value for name, value in self.figures.items()},
                "train/lr": lr,
                "train/step_time_ms": step_ms,
                **{f"train/{name}": value for name, value in rates.items()},
                "train/data_wait_ms": data_wait_ms,
            }
            history.record(metrics, step)
            if self.strategy.is_main:
                eta_s = (self.trainer.max_steps - step) * step_ms / 1000
                log.info(
                    progress_line(
                        step,
                        self.trainer.max_steps,
                        self.figures["loss"],
                        rates,
                        data_wait_ms,
                        eta_s,
                    )
                )
        return metrics


class Evaluation:
    """The task's figures over a held-out split, recorded as `<split>/<figure>`: the validation
    split every `trainer.eval_every` steps and at the last (`maybe_run`), the test split once
    after training (`run`)."""

    def __init__(
        self,
        trainer: TrainerConfig,
        strategy: TrainingStrategy,
        task: Task,
        batches: ValBatches,
        speed: Throughput,
        split: str = "val",
        counting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        """`counting`: a context for each evaluation, such as `TensorPeak.evaluation`;
        `weights`: one that puts the weights to score in the model (`EMA.evaluated`)."""
        self.trainer, self.strategy, self.task, self.speed = trainer, strategy, task, speed
        self.batches, self.split, self.counting = batches, split, counting
        self.weights = weights
        self.figures: dict[str, float] = {"loss": math.nan}

    def due(self, step: int) -> bool:
        return due(self.trainer.eval_every, step)

    def maybe_run(
        self, step: int, model: torch.nn.Module, precision: Any, history: History, force: bool
    ) -> dict[str, float]:
        """The metrics recorded at `step` ({} when not due)."""
        if not (force or self.due(step)):
            return {}
        return self.run(step, model, precision, history)

    def run(
        self, step: int, model: torch.nn.Module, precision: Any, history: History
    ) -> dict[str, float]:
        with self.speed.paused(), self.counting(), self.weights():
            self.figures = evaluate(
                model,
                self.strategy,
                self.task,
                self.batches,
                self.trainer.eval_batch,
                precision,
                split=self.split,
            )
            metrics = {f"{self.split}/{name}": value for name, value in self.figures.items()}
            history.record(metrics, step)
            if self.strategy.is_main:
                shown = " | ".join(
                    f"{self.split} {name} {v:.4g}" for name, v in self.figures.items()
                )
                log.info("step %d | %s", step, shown)
        return metrics


class Checkpointing:
    """A checkpoint every `trainer.checkpoint_every` steps, and whenever forced (the last step, a
    stop); a forced one is complete on disk before `maybe_save` returns. None at all unless
    `enabled` (trainer.checkpoint)."""

    def __init__(
        self,
        writer: CheckpointWriter,
        every: int,
        speed: Throughput,
        start_step: int,
        enabled: bool,
    ):
        self.writer, self.every, self.speed, self.enabled = writer, every, speed, enabled
        self.last_step = start_step or None  # the newest checkpoint's step
        self.blocked_s: list[float] = []  # how long each checkpoint held training up

    def due(self, step: int) -> bool:
        return self.enabled and due(self.every, step)

    def maybe_save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: Callable[[], dict[str, Any]],
        force: bool,
    ) -> Path | None:
        """The folder the checkpoint is (or, saved asynchronously, will be) published as, None
        if it could not be written (trainer.checkpoint_errors=warn); `train_state` gives what it
        holds besides model and optimizer (`Trainer.state_dict`)."""
        if not (self.due(step) or (force and self.enabled)):
            return None
        with self.speed.paused():
            started = time.perf_counter()
            saved_to = self.writer.save(model, optimizer, train_state())
            self.blocked_s.append(time.perf_counter() - started)
            if force and not self.writer.wait():
                saved_to = None
        if saved_to is not None:
            self.last_step = step
        return saved_to
