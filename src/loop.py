"""The training loop every strategy shares, readable top to bottom.

It knows the optimizer, the accumulation count and `strategy.is_main`; how the model is placed,
split or replicated, and where the loss is computed, belong to the strategy (`strategies/base.py`).
Nothing here waits on the devices except on logging, eval and checkpoint steps.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from src.checkpoint import rng_state, save_atomic
from src.data import Data, Split, train_batches, val_batches
from src.objective import eval_sums, loss_sum
from src.optim import lr_schedule
from src.strategies.base import Strategy

log = logging.getLogger(__name__)


class Throughput:
    """Steady-state speed: steps before `warmup_steps` and time spent outside training (eval,
    checkpoints) are left out; step time is the median over logging windows."""

    def __init__(self, warmup_steps: int, samples_per_step: int):
        self.warmup_steps = warmup_steps
        self.samples_per_step = samples_per_step
        self.steady_since: float | None = None
        self.steady_steps = 0
        self.excluded = 0.0
        self.window_start = time.perf_counter()
        self.window_steps = 0
        self.window_ms: list[float] = []

    def step_done(self, step: int, strategy: Strategy) -> None:
        self.window_steps += 1
        if step == self.warmup_steps:
            strategy.synchronize()
            self.steady_since = self.window_start = time.perf_counter()
            self.window_steps = 0
        elif self.steady_since is not None:
            self.steady_steps += 1

    def close_window(self) -> float:
        """End a logging window (the caller has synchronized); returns its ms per step."""
        now = time.perf_counter()
        ms = 1000 * (now - self.window_start) / max(1, self.window_steps)
        if self.steady_since is not None and self.window_steps:
            self.window_ms.append(ms)
        self.window_start, self.window_steps = now, 0
        return ms

    def pause(self) -> float:
        return time.perf_counter()

    def resume(self, paused_at: float) -> None:
        elapsed = time.perf_counter() - paused_at
        self.excluded += elapsed
        self.window_start += elapsed

    def summary(self) -> dict[str, float]:
        if self.steady_since is None or not self.steady_steps:
            return {"samples_per_sec": float("nan"), "step_time_ms": float("nan")}
        seconds = time.perf_counter() - self.steady_since - self.excluded
        return {
            "samples_per_sec": self.steady_steps * self.samples_per_step / seconds,
            "step_time_ms": statistics.median(self.window_ms) if self.window_ms else float("nan"),
        }


def evaluate(
    model: torch.nn.Module, strategy: Strategy, split: Split, batch_size: int, autocast: Any
) -> tuple[float, float]:
    """Mean loss and accuracy over the whole validation set (all ranks together)."""
    model.eval()
    sums = torch.zeros(2)
    with torch.no_grad(), autocast:
        for inputs, targets in val_batches(split, batch_size, strategy.rank, strategy.world_size):
            sums += strategy.apply(model, inputs, targets, eval_sums).float().cpu()
    model.train()
    loss, correct = strategy.all_reduce_sum(sums).tolist()
    count = split.targets.numel()
    return loss / count, correct / count


def write_checkpoint(
    path: Path,
    strategy: Strategy,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    cfg: DictConfig,
    tracker_run_id: str | None,
) -> None:
    state = {
        "model": strategy.unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "rng": rng_state(),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "wandb_run_id": tracker_run_id,
    }
    if strategy.is_main:
        save_atomic(state, path)
    strategy.barrier()


def progress_line(
    step: int, max_steps: int, loss: float, samples_per_sec: float, eta_s: float
) -> str:
    filled = round(20 * step / max_steps)
    bar = "#" * filled + "." * (20 - filled)
    return (
        f"[{bar}] step {step}/{max_steps} | loss {loss:.4f} | "
        f"{samples_per_sec:,.0f} samples/s | eta {eta_s:.0f}s"
    )


def fit(
    cfg: DictConfig,
    strategy: Strategy,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Data,
    tracker: Any,
    run_dir: Path,
) -> dict[str, Any]:
    """Train for `trainer.max_steps` optimizer steps; returns the final figures."""
    trainer = cfg.trainer
    params = list(strategy.unwrap(model).parameters())
    micro_batch = trainer.batch_size // trainer.accumulate
    batches = train_batches(data.train, micro_batch, cfg.seed, strategy.rank, strategy.world_size)
    autocast = torch.autocast(
        strategy.device_type, dtype=torch.bfloat16, enabled=trainer.precision == "bf16"
    )
    lr_at = lr_schedule(cfg.optimizer, trainer.max_steps)
    history = (run_dir / "metrics.jsonl").open("a") if strategy.is_main else None
    speed = Throughput(trainer.timing_warmup_steps, trainer.batch_size)
    running_loss, steps_since_log = 0.0, 0  # becomes a tensor on the loss's device
    train_loss = val_loss = val_accuracy = float("nan")
    started = time.perf_counter()

    def record(metrics: dict[str, float], step: int) -> None:
        tracker.log(metrics, step=step)
        if history:
            history.write(json.dumps({"step": step, **metrics}) + "\n")
            history.flush()

    model.train()
    for step in range(1, trainer.max_steps + 1):
        lr = lr_at(step - 1)
        for group in optimizer.param_groups:
            group["lr"] = lr

        for micro_step in range(trainer.accumulate):
            inputs, targets = next(batches)
            with strategy.grad_sync(model, enabled=micro_step == trainer.accumulate - 1):
                with autocast:
                    total = strategy.apply(model, inputs, targets, loss_sum)
                loss = total / (targets.numel() * trainer.accumulate)
                loss.backward()
            running_loss = running_loss + loss.detach()

        if trainer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps_since_log += 1
        speed.step_done(step, strategy)

        last = step == trainer.max_steps
        if step % trainer.log_every == 0 or last:
            train_loss = strategy.all_reduce_sum(running_loss).item() / (
                steps_since_log * strategy.world_size
            )
            step_ms = speed.close_window()
            samples_per_sec = trainer.batch_size * 1000 / step_ms
            running_loss, steps_since_log = 0.0, 0
            memory = dict(zip(*strategy.local_peak_memory_mb(), strict=True))
            record(
                {
                    **{f"memory/{device}_peak_mb": mb for device, mb in memory.items()},
                    "train/loss": train_loss,
                    "train/lr": lr,
                    "train/step_time_ms": step_ms,
                    "train/samples_per_sec": samples_per_sec,
                },
                step,
            )
            if strategy.is_main:
                eta = (trainer.max_steps - step) * step_ms / 1000
                log.info(progress_line(step, trainer.max_steps, train_loss, samples_per_sec, eta))

        if (trainer.eval_every and step % trainer.eval_every == 0) or last:
            paused = speed.pause()
            val_loss, val_accuracy = evaluate(
                model, strategy, data.val, trainer.eval_batch_size, autocast
            )
            record({"val/loss": val_loss, "val/accuracy": val_accuracy}, step)
            if strategy.is_main:
                log.info(
                    "step %d | val loss %.4f | val accuracy %.2f%%",
                    step,
                    val_loss,
                    100 * val_accuracy,
                )
            speed.resume(paused)

        if (trainer.checkpoint_every and step % trainer.checkpoint_every == 0) or last:
            paused = speed.pause()
            write_checkpoint(
                run_dir / "checkpoints" / "last.pt",
                strategy,
                model,
                optimizer,
                step,
                cfg,
                tracker.run_id,
            )
            speed.resume(paused)

    if history:
        history.close()
    memory_devices, memory_mb = strategy.peak_memory_mb()
    return {
        "steps": trainer.max_steps,
        "final_train_loss": train_loss,
        "final_val_loss": val_loss,
        "val_accuracy": val_accuracy,
        **speed.summary(),
        "peak_memory_mb": memory_mb,
        "memory_devices": memory_devices,
        "wall_time_s": time.perf_counter() - started,
    }
