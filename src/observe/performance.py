"""How much arithmetic a training step does, and how much of the hardware's peak a run reaches.

FLOPs are counted once, before training, by `torch.utils.flop_counter.FlopCounterMode` over a
forward pass, the loss and a backward pass of the whole global batch on the meta device (shapes
only: no memory, no compute, any model size). They are the model's FLOPs: recomputation by
activation checkpointing is not counted, so MFU stays comparable with and without it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from src.components.data_contract import Data, meta_samples
from src.config.trainer import TrainerConfig
from src.observe.tracking import Trackers
from src.parallel.base import Strategy
from src.runtime.run_folder import profile_trace

# Dense peak TFLOP/s per GPU from NVIDIA's data sheets (SXM parts unless named), by arithmetic:
# tf32 is what fp32 matmuls run at with trainer.matmul_precision high/medium (auto on CUDA).
# Looked up by the longest name that the device's name contains ("H100 PCIe" before "H100").
PEAK_TFLOPS = {
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}

log = logging.getLogger(__name__)


def step_flops(model: nn.Module, task: Any, data: Data, batch_size: int) -> int | None:
    """FLOPs of one optimizer step (forward, the task's loss and backward over `batch_size`
    samples) of `model`, built on the meta device; None for a model that cannot run there."""
    inputs, targets = meta_samples(data.train, batch_size)
    try:
        with FlopCounterMode(display=False) as counter:
            task.sums(model(inputs), targets)[0].backward()
    except Exception:  # noqa: BLE001 - a model that cannot run on the meta device still trains
        log.info("the model does not run on the meta device, so its FLOPs are not counted")
        return None
    return counter.get_total_flops()


def table_peak_tflops(device_name: str, precision: str, matmul_precision: str) -> float | None:
    """One GPU's peak for the run's arithmetic from `PEAK_TFLOPS`, or None when not listed."""
    names = sorted((n for n in PEAK_TFLOPS if n in device_name), key=len, reverse=True)
    if not names:
        return None
    peaks = PEAK_TFLOPS[names[0]]
    if precision == "fp32" and matmul_precision != "highest" and "tf32" in peaks:
        return peaks["tf32"]
    return peaks.get(precision)


def device_peak_tflops(
    configured: float | None, device: torch.device, precision: str, matmul_precision: str
) -> float | None:
    """`trainer.peak_tflops` when set, else the table's figure for this GPU (None on CPU)."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    return table_peak_tflops(torch.cuda.get_device_name(device), precision, matmul_precision)


def throughput_figures(
    flops_per_step: int | None, step_time_ms: float, devices: int, peak_tflops: float | None
) -> dict[str, float]:
    """Achieved TFLOP/s of the whole job and of each of its `devices` and, with a known
    per-device peak, its MFU (model FLOPs utilisation: the share of that peak each device
    reaches)."""
    if flops_per_step is None:
        return {}
    tflops_per_sec = flops_per_step / (step_time_ms / 1000) / 1e12
    per_device = tflops_per_sec / devices
    figures = {
        "flops_per_step": flops_per_step,
        "tflops_per_sec": tflops_per_sec,
        "tflops_per_sec_per_device": per_device,
    }
    if peak_tflops is not None:
        figures["mfu"] = per_device / peak_tflops
    return figures


class NoProfiler:
    def step(self) -> None:
        pass


def step_profiler(
    enabled: bool, steps: int, device_type: str, trace_path: Path
) -> contextlib.AbstractContextManager:
    """A torch.profiler over `steps` training steps after one step to settle and one of profiler
    warm-up, written as a Chrome trace to `trace_path` (open it in https://ui.perfetto.dev or
    chrome://tracing); the loop calls `.step()` after each step. A no-op when not `enabled`."""
    if not enabled:
        return contextlib.nullcontext(NoProfiler())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=steps, repeat=1),
        on_trace_ready=lambda profiler: profiler.export_chrome_trace(str(trace_path)),
        record_shapes=True,
    )


@contextlib.contextmanager
def profiling(
    trainer: TrainerConfig, strategy: Strategy, run_dir: Path, tracker: Trackers
) -> Iterator:
    """`trainer.profile`'s profiler, on the main process (a no-op otherwise); the trace it writes
    as it closes goes to the tracker too, unless training failed."""
    enabled = trainer.profile and strategy.is_main
    trace = profile_trace(run_dir)
    with step_profiler(enabled, trainer.profile_steps, strategy.device_type, trace) as profiler:
        yield profiler
    if enabled:
        tracker.save(trace)
