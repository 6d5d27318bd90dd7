"""What one training step and one evaluation pass compute: a step's gradients
(`forward_backward`) and update (`Stepper`), and the task's figures over a split (`evaluate`).

They know the optimizer, the accumulation count and `strategy.is_main`; how the model is placed,
split or replicated, and where the loss is computed, belong to the strategy (`parallel/base.py`).
Nothing here waits on the devices except with `trainer.skip_nonfinite` (every step) and at the
end of an evaluation.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from src.components.batch_order import ValBatches
from src.components.data_contract import Split, StreamReader
from src.components.precision import LossScaling, autocast
from src.components.tasks import Task
from src.config.trainer import TrainerConfig
from src.parallel.base import TrainingStrategy
from src.runtime.progress import PhaseProgress
from src.runtime.stopping import NonFiniteWatch

if TYPE_CHECKING:
    from src.training.predictions import SampleOutputs

log = logging.getLogger(__name__)


def evaluate(
    model: torch.nn.Module,
    strategy: TrainingStrategy,
    task: Task,
    val: Split | Dataset | ValBatches,
    batch_size: int,
    autocast: Any,
    outputs: SampleOutputs | None = None,
    split: str = "val",
) -> dict[str, float]:
    """The task's figures (mean loss, ...) over the whole validation set (all ranks together);
    `val` is the set, or this rank's `ValBatches` of it (which `batch_size` made). `outputs`,
    if given, keeps the model's outputs for each of this rank's samples (`eval.py predict=true`).
    A long pass shows its progress in batches (`src/runtime/progress.py`)."""
    if not isinstance(val, ValBatches):
        val = ValBatches(val, batch_size, strategy.data_shard, strategy.data_shards)
    model.eval()
    sums, count = None, 0
    with torch.no_grad(), autocast, PhaseProgress(split, len(val.order), unit="batch") as progress:
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
            progress.advance()
    model.train()
    return reduced_figures(strategy, task, sums, count)


def reduced_figures(
    strategy: TrainingStrategy, task: Task, sums: torch.Tensor, count: int | torch.Tensor
) -> dict[str, float]:
    """`task.figures` of `sums` over `count` targets, both summed over all processes."""
    counts = torch.as_tensor(count, dtype=sums.dtype, device=sums.device).reshape(1)
    *totals, total = strategy.all_reduce_sum(torch.cat([sums, counts])).tolist()
    return task.figures(totals, total)


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

    def position(self) -> dict[int, list[int]] | None:
        """Where a stream's batches have got to (`StreamReader.state_dict`); None for batches
        that are a function of the step. Nothing is read ahead, so it is the last batch's."""
        return self.batches.state_dict() if isinstance(self.batches, StreamReader) else None


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
