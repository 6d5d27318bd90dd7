"""The parts of the training loop (`Trainer.train`, `trainer.py`): one step's gradients
(`forward_backward`) and update (`Stepper`), and the parts that each decide when they are due:
progress, evaluation, checkpointing.

They know the optimizer, the accumulation count and `strategy.is_main`; how the model is placed,
split or replicated, and where the loss is computed, belong to the strategy (`parallel/base.py`).
Nothing here waits on the devices except on logging, eval and checkpoint steps (and on every step
with `trainer.skip_nonfinite`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import operator
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
from torch.utils.data import Dataset

from src.checkpoint.writer import CheckpointWriter
from src.components.data import Split, ValBatches
from src.components.precision import LossScaling, autocast
from src.components.tasks import Task
from src.config.schema import ConfigError, TrainerConfig
from src.observe.report import rate_text
from src.observe.tracking import Tracker
from src.parallel.base import TrainingStrategy
from src.runtime.stopping import NonFiniteWatch

if TYPE_CHECKING:
    from src.training.predictions import SampleOutputs

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


def evaluate(
    model: torch.nn.Module,
    strategy: TrainingStrategy,
    task: Task,
    val: Split | Dataset | ValBatches,
    batch_size: int,
    autocast: Any,
    outputs: SampleOutputs | None = None,
) -> dict[str, float]:
    """The task's figures (mean loss, ...) over the whole validation set (all ranks together);
    `val` is the set, or this rank's `ValBatches` of it (which `batch_size` made). `outputs`,
    if given, keeps the model's outputs for each of this rank's samples (`eval.py predict=true`)."""
    if not isinstance(val, ValBatches):
        val = ValBatches(val, batch_size, strategy.data_shard, strategy.data_shards)
    model.eval()
    sums, count = None, 0
    with torch.no_grad(), autocast:
        for batch, (inputs, targets, counted) in enumerate(val):
            if outputs is None:
                part = strategy.apply(model, inputs, targets, task.sums)
            else:
                part = outputs.apply(model, strategy, task, inputs, targets, val.order[batch])
            part = part.float()
            if counted:
                count = count + task.count(targets)
            else:  # padding: zeros of the right length, for a rank with no samples of its own
                part = part * 0
            sums = part if sums is None else sums + part  # summed on the device: one wait
    model.train()
    return reduced_figures(strategy, task, sums, count)


def reduced_figures(
    strategy: TrainingStrategy, task: Task, sums: torch.Tensor, count: int | torch.Tensor
) -> dict[str, float]:
    """`task.figures` of `sums` over `count` targets, both summed over all processes."""
    counts = torch.as_tensor(count, dtype=sums.dtype, device=sums.device).reshape(1)
    *totals, total = strategy.all_reduce_sum(torch.cat([sums, counts])).tolist()
    return task.figures(totals, total)


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
    filled = round(20 * step / max_steps)
    bar = "#" * filled + "." * (20 - filled)
    speed = f"{rate_text(rates['samples_per_sec'])} samples/s"
    if "tokens_per_sec" in rates:
        speed += f" | {rate_text(rates['tokens_per_sec'])} tokens/s"
    return (
        f"[{bar}] step {step}/{max_steps} | loss {loss:.4f} | {speed} | "
        f"data wait {data_wait_ms:.1f} ms | eta {eta_s:.0f}s"
    )


@contextlib.contextmanager
def open_history(tracker: Tracker, path: Path, start_step: int, is_main: bool) -> Iterator[History]:
    """The run's `History`: the tracker, and `metrics.jsonl` (main process only) opened to append
    the rows after `start_step`.

    Rows past `start_step` come from a run that died after its last checkpoint (or an earlier run
    in this folder); they are dropped first, so the file reads as one uninterrupted run."""
    if not is_main:
        yield History(tracker, None)
        return
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if history_step(line) <= start_step]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)
    with path.open("a") as file:
        yield History(tracker, file)


def history_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError):  # a line cut short by a crash
        return math.inf


def forward_backward(
    model: torch.nn.Module,
    strategy: TrainingStrategy,
    task: Task,
    batches: Iterator,
    autocast: Any,
    accumulate: int,
    scaling: LossScaling,
) -> tuple[torch.Tensor, int | torch.Tensor]:
    """Gradients of one optimizer step, accumulated over `accumulate` micro-batches (of the mean
    loss as `scaling` scales it). Returns this process's task sums over the step's targets
    (detached, still on the device) and the number of those targets (`task.count`)."""
    micro_batches = [next(batches) for _ in range(accumulate)]
    targets_seen = sum(task.count(targets) for _, targets in micro_batches)
    mean_divisor = step_divisor(strategy, targets_seen)
    step_sums = None
    for micro_step, (inputs, targets) in enumerate(micro_batches):
        with strategy.grad_sync(model, enabled=micro_step == accumulate - 1):
            with autocast:
                sums = strategy.apply(model, inputs, targets, task.sums)
            scaling.scale(sums).backward(mean_loss_gradient(sums, mean_divisor))
        sums = sums.detach()
        step_sums = sums if step_sums is None else step_sums + sums
    return step_sums, targets_seen


def mean_loss_gradient(sums: torch.Tensor, divisor: int | torch.Tensor) -> torch.Tensor:
    """The gradient `sums.backward` takes to backpropagate the mean loss, sums[0] / divisor,
    and nothing of the other sums: [1 / divisor, 0, ...]. Given to backward whole, it spares
    the select and the division that `(sums[0] / divisor).backward()` runs, and their backward
    ops, every micro-step; a divisor known from the shapes (an int) reuses one tensor."""
    if torch.is_tensor(divisor):
        return first_unit(len(sums), sums.dtype, sums.device) / divisor
    return divided_first_unit(len(sums), sums.dtype, sums.device, divisor)


@functools.lru_cache(maxsize=16)
def first_unit(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    unit = torch.zeros(size, dtype=dtype, device=device)
    unit[0] = 1
    return unit


@functools.lru_cache(maxsize=16)
def divided_first_unit(
    size: int, dtype: torch.dtype, device: torch.device, divisor: int
) -> torch.Tensor:
    return first_unit(size, dtype, device) / divisor  # as the division's backward computes it


class TimedBatches:
    """An iterator of batches that adds up the time its `next` waited: input the loop waited
    for (a DataLoader's workers falling behind, or reading in the training process). In-memory
    batches cost an index, nothing to wait on."""

    def __init__(self, batches: Iterator):
        self.batches = batches
        self.wait_s = 0.0  # since the last `take_wait`

    def __iter__(self) -> TimedBatches:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        batch = next(self.batches)
        self.wait_s += time.perf_counter() - started
        return batch

    def take_wait(self) -> float:
        """Seconds waited since the last call."""
        waited, self.wait_s = self.wait_s, 0.0
        return waited


def step_divisor(
    strategy: TrainingStrategy, targets_seen: int | torch.Tensor
) -> int | torch.Tensor:
    """What this process divides its loss sum by so that the gradients (which data-parallel
    strategies average over their processes) are those of the step's global mean loss.

    A count known from the shapes (an int) is the same on every process: its own will do. A count
    that depends on the targets (a tensor: pixels not ignored, say) differs between processes, so
    its sum over all of them is taken, one collective a step, before any backward pass."""
    if isinstance(targets_seen, int):
        return targets_seen
    total = strategy.all_reduce_sum(targets_seen.detach().float().clone())
    # The data shards' processes are those that all_reduce_sum adds and that average gradients.
    return total.clamp(min=1) / strategy.data_shards


def finite_everywhere(strategy: TrainingStrategy, step_loss: torch.Tensor) -> bool:
    """Whether every process's loss is finite; all processes get the same answer. It waits on
    the device every step, which is why skipping non-finite steps is opt-in."""
    return torch.isfinite(strategy.all_reduce_sum(step_loss.clone())).item()  # may sum in place


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

    def __init__(self, tracker: Tracker, file: TextIO | None):
        self.tracker, self.file = tracker, file

    def record(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log(metrics, step=step)
        if self.file:
            self.file.write(json.dumps({"step": step, **metrics}) + "\n")
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
            memory = dict(zip(*self.strategy.local_peak_memory_mb(), strict=True))
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
    ):
        self.trainer, self.strategy, self.task, self.speed = trainer, strategy, task, speed
        self.batches, self.split = batches, split
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
        with self.speed.paused():
            self.figures = evaluate(
                model, self.strategy, self.task, self.batches, self.trainer.eval_batch, precision
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


class Monitoring:
    """`trainer.monitor`'s best value: at each step where the metric is logged (for val/*, the
    evaluation steps) and improves on the best so far, the best checkpoint
    (`checkpoints/best/`); with `trainer.early_stop_patience` N, the stop after N values in a
    row without improvement, and the best weights kept in memory (a copy of this process's
    share of the model) for the test pass to score. Every process sees the same all-reduced
    value, so all of them write, count and stop alike."""

    def __init__(
        self,
        trainer: TrainerConfig,
        strategy: TrainingStrategy,
        writer: CheckpointWriter,
        speed: Throughput,
    ):
        self.metric, self.patience = trainer.monitor, trainer.early_stop_patience
        self.better = operator.lt if trainer.monitor_mode == "min" else operator.gt
        self.strategy, self.writer, self.speed = strategy, writer, speed
        self.saves = trainer.checkpoint  # trainer.checkpoint=false: the best is only tracked
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.since_best = 0  # values logged since the best
        self.best_weights: dict[str, torch.Tensor] | None = None  # with early stopping only

    def observe(
        self,
        step: int,
        logged: dict[str, float],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: Callable[[], dict[str, Any]],
    ) -> bool:
        """Take the metrics `logged` at `step`; whether the patience has run out."""
        if self.metric is None or not logged_with(self.metric, logged):
            return False
        if self.metric not in logged:  # a model that could not run on the meta device escapes
            raise ConfigError(  # the check before training (`checks.check_monitor`)
                f"trainer.monitor={self.metric} is not logged; this run logs "
                f"{', '.join(logged)}"
            )
        value = logged[self.metric]
        if self.best_value is None or self.better(value, self.best_value):
            self.best_value, self.best_step, self.since_best = value, step, 0
            with self.speed.paused():
                if self.saves:
                    self.writer.save(model, optimizer, train_state(), best=True)
                if self.patience:
                    self.best_weights = weights_copy(self.strategy.unwrap(model))
            return False
        self.since_best += 1
        return 0 < self.patience <= self.since_best

    def restore_best(self, model: torch.nn.Module) -> None:
        """Put the best weights back into `model` (early stopping kept them)."""
        self.strategy.unwrap(model).load_state_dict(self.best_weights)

    def stop_reason(self) -> str:
        return (
            f"stopping early: {self.metric} has not improved on its best, {self.best_value:.4g} "
            f"at step {self.best_step}, for {self.since_best} values "
            f"(trainer.early_stop_patience={self.patience})"
        )

    def summary(self) -> dict[str, Any]:
        if self.metric is None:
            return {}
        return {"monitor": self.metric, "best_step": self.best_step, "best_value": self.best_value}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it, so that a resumed run goes on from the same best."""
        return {
            "best_value": self.best_value,
            "best_step": self.best_step,
            "since_best": self.since_best,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value, self.best_step = state["best_value"], state["best_step"]
        self.since_best = state["since_best"]


def logged_with(metric: str, logged: dict[str, float]) -> bool:
    """Whether `logged` holds the metrics of `metric`'s kind (`val/...`: an evaluation's)."""
    kind = metric.split("/", 1)[0]
    return any(name.startswith(f"{kind}/") for name in logged)


def weights_copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of `module`'s state_dict (this process's shards, for sharded models), where the
    module holds it, that `load_state_dict` puts back."""
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


class Stepper:
    """An optimizer step after the gradients of `forward_backward`: unless the loss is non-finite
    and `trainer.skip_nonfinite` skips it, clipping and the update. Holds what the step runs
    under: autocast, fp16's loss scaling and the watch for non-finite losses."""

    def __init__(
        self,
        trainer: TrainerConfig,
        strategy: TrainingStrategy,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
    ):
        self.trainer, self.strategy, self.optimizer = trainer, strategy, optimizer
        self.params = strategy.trained_parameters(model)
        self.precision = autocast(strategy.device_type, trainer.precision)
        self.scaling = LossScaling(
            strategy.grad_scaler(trainer.precision == "fp16", trainer.loss_scale_init)
        )
        self.nonfinite = NonFiniteWatch()
        self.skipped_steps = 0

    def update(self, step: int, lr: float, step_sums: torch.Tensor) -> bool:
        """The optimizer step at `lr` after the step's gradients; False if it was skipped."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        stepped = not self.trainer.skip_nonfinite or finite_everywhere(self.strategy, step_sums[0])
        if stepped:
            self.nonfinite.observe(step, step_sums)
            if self.trainer.grad_clip > 0:
                self.scaling.unscale(self.optimizer)
                self.strategy.clip_grad_norm(self.params, self.trainer.grad_clip)
            self.scaling.step(self.optimizer)
        else:
            self.skipped_steps += 1
            if self.strategy.is_main:
                log.warning("step %d: non-finite loss, optimizer step skipped", step)
        self.optimizer.zero_grad(set_to_none=True)
        return stepped
