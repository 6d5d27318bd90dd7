"""The run's summary: the speed and resource figures it reports, summary.json in the run folder
and its lines in the log, also for a run found complete on resume."""

from __future__ import annotations

import json
import logging
import math
import os
import textwrap
from pathlib import Path
from typing import Any

import torch

from src.config.job import JobConfig
from src.config.trainer import TrainerConfig
from src.observe.performance import device_peak_tflops, throughput_figures
from src.parallel.base import Strategy
from src.parallel.devices import usable_cores
from src.runtime.files import json_text
from src.runtime.ranks import Ranks
from src.runtime.run_folder import metrics_file, summary_file
from src.training.loop import history_step

log = logging.getLogger(__name__)


def finish_finished_run(
    job: JobConfig,
    run_dir: Path,
    strategy: Strategy,
    checkpoint: Path,
    state: dict[str, Any],
    ranks: Ranks | None,
) -> dict[str, Any]:
    """The summary of a run that had trained all its steps or stopped early (`state`: its last
    checkpoint's); written if the run died before."""
    path = summary_file(run_dir)
    log.info(
        "%s is at step %d of trainer.max_steps=%d%s: this run is complete, nothing to do",
        checkpoint,
        state["step"],
        job.trainer.max_steps,
        " (stopped early)" if state.get("stopped_early") else "",
    )
    if path.exists() or (ranks is not None and ranks.rank != 0):
        return json.loads(path.read_text()) if path.exists() else {}
    history = metrics_file(run_dir)
    lines = history.read_text().splitlines() if history.exists() else []
    rows = [json.loads(line) for line in lines if history_step(line) < math.inf]  # whole lines

    def last(key: str) -> float:
        return next((row[key] for row in reversed(rows) if key in row), math.nan)

    summary = {
        "strategy": strategy.name,
        "devices": job.cfg.parallel.devices,
        "world_size": strategy.data_shards,
        "global_batch": job.trainer.batch_size,
        "steps": state["step"],
        "final_train_loss": last("train/loss"),
        "final_train_accuracy": last("train/accuracy"),
        "final_val_loss": last("val/loss"),
        "val_accuracy": last("val/accuracy"),
        "completed_before_resume": True,  # the timings were lost with the process that trained
    }
    write_summary(summary, run_dir)
    return summary


def write_summary(summary: dict[str, Any], run_dir: Path) -> None:
    """summary.json in the run folder, and the summary in the log."""
    save_summary(summary, run_dir)
    log.info(format_summary(summary, run_dir))


def save_summary(summary: dict[str, Any], run_dir: Path) -> None:
    """summary.json in the run folder; a figure that could not be measured (NaN) is null."""
    summary_file(run_dir).write_text(json_text(summary, indent=2) + "\n")


def format_summary(summary: dict[str, Any], run_dir: Path) -> str:
    """`key=value` for every figure of summary.json, a few to a line."""

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return "nan"
            return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
        if isinstance(value, list):
            return ",".join(fmt(v) for v in value)
        text = str(value)
        return json.dumps(text) if " " in text else text  # a sentence (chosen_by) in quotes

    pairs = [f"{key}={fmt(value)}" for key, value in summary.items()]
    pairs.append(f"outputs={run_dir}")
    text = "run summary: " + " ".join(pairs)
    wrap = textwrap.TextWrapper(
        width=100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
    )
    return "\n".join(wrap.wrap(text))


def speed_figures(
    trainer: TrainerConfig,
    strategy: Strategy,
    flops_per_step: int | None,
    results: dict[str, Any],
    matmul_precision: str,
) -> dict[str, float]:
    """TFLOP/s of all devices together and per device (of every device the job computes on:
    tp and pp peers, dp's replicas and model_parallel's stages included), and MFU where the
    devices' peak is known."""
    peak = device_peak_tflops(
        trainer.peak_tflops, strategy.devices[0], trainer.precision, matmul_precision
    )
    return throughput_figures(flops_per_step, results["step_time_ms"], strategy.job_devices, peak)


def run_summary(
    job: JobConfig,
    strategy: Strategy,
    results: dict[str, Any],
    flops_per_step: int | None,
    matmul_precision: str,
) -> dict[str, Any]:
    """summary.json's figures: what ran, the loop's `results`, and the speed and resources
    behind them."""
    parallel = job.cfg.parallel
    return {
        "strategy": strategy.name,
        **({"chosen_by": parallel.chosen_by} if parallel.chosen_by else {}),
        "devices": parallel.devices,
        "world_size": strategy.data_shards,
        "global_batch": job.trainer.batch_size,
        "matmul_precision": matmul_precision,
        **results,
        **speed_figures(job.trainer, strategy, flops_per_step, results, matmul_precision),
        **cpu_share(strategy),
        **strategy.report(),
    }


def cpu_share(strategy: Strategy) -> dict[str, Any]:
    """This node's processes, each one's intra-op threads, and the cores they may use: with more
    threads than cores the processes compete for them, and the scaling report says so. Also
    the CPU kernels ATen runs (its SIMD level: ATEN_CPU_CAPABILITY chooses a lower one), by
    which CPU runs round differently."""
    share = {
        "processes_per_node": strategy.processes_per_node,
        "threads_per_process": torch.get_num_threads(),
        "cores": usable_cores(),
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
    }
    if hasattr(os, "sched_getaffinity"):  # which cores: a concurrent sweep gives each job its own
        share["cpu_affinity"] = sorted(os.sched_getaffinity(0))
    return share


def reset_peak_memory(strategy: Strategy) -> None:
    """A multirun runs its jobs in one process: each job's peak memory must count from its
    start. torch's reset does not initialise CUDA itself and fails with "Invalid device
    argument" on a process that has not touched the GPU yet (seen with parallel=single on an
    H200)."""
    cuda_devices = {device for device in strategy.devices if device.type == "cuda"}
    if cuda_devices:
        torch.cuda.init()
    for device in cuda_devices:
        torch.cuda.reset_peak_memory_stats(device)
