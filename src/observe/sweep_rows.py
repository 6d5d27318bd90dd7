"""A sweep's jobs read into rows, one per job, for the scaling report (`src/observe/report.py`).

Each job directory holds `.hydra/` (its config and overrides), `status.json` (see
`src/launch/sweep.py`) and, when it trained, `summary.json`. Speed-up is over the sweep's `single`
job (the one with the same swept settings outside `parallel`); scaling efficiency is speed-up /
devices. A mesh layout's job is named by its degrees (`fsdp2xtp2`, `tp2`, `pp2-1F1B`: its
summary.json's `layout`); a pipeline's shows its schedule's theoretical bubble beside each pp
rank's measured idle fraction. Numbers that cannot be trusted are flagged, with the reason:
more threads than cores, step times that disagree between logging windows, and efficiencies over
100%.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from src.config.parallel import node_range
from src.runtime.files import finite_or_null
from src.runtime.run_folder import hydra_file, status_file, summary_file

log = logging.getLogger(__name__)

SWEPT_BY_STRATEGY = ("parallel", "parallel.devices")
STATUSES = ("ok", "skipped", "failed")  # a job's outcome (src/launch/sweep.py)
# A job whose logging windows' step times differ by more than this fraction of their median was
# disturbed while it ran (see `Throughput` in src/training/loop.py).
NOISY_SPREAD = 0.5

# Why a flagged number cannot be trusted, and what to do about it (printed under the table).
FLAG_REASONS = {
    "oversubscribed": (
        "more threads (processes x intra-op threads) than cores: the processes compete for the "
        "cores, so the speed measures the machine more than the strategy. Lower "
        "parallel.threads_per_rank (or OMP_NUM_THREADS) or parallel.devices until processes x "
        "threads <= cores."
    ),
    "noisy": (
        f"step times differ by more than {NOISY_SPREAD:.0%} of their median between logging "
        "windows: something else ran on the machine. Rerun on a quiet machine, or with more "
        "trainer.max_steps."
    ),
    "efficiency > 100%": (
        "faster per device than the single job: not a real speed-up. The single baseline or this "
        "job was disturbed (see noisy), or the baseline was oversubscribed; rerun on a quiet "
        "machine."
    ),
}


@dataclass
class Row:
    job: str
    strategy: str
    devices: int
    """Devices of the whole job: parallel.devices x parallel.nodes (its most, if elastic)."""
    variant: str
    """The job's swept settings other than the strategy and device count, e.g. `model=mlp`."""
    world_size: int | None = None
    samples_per_sec: float | None = None
    tokens_per_sec: float | None = None
    """Input tokens per second, for token sequences (language models)."""
    tflops_per_sec: float | None = None
    """Model FLOP/s of all the job's devices together, in TFLOP/s."""
    mfu: float | None = None
    """Model FLOPs utilisation, where the devices' peak is known (trainer.peak_tflops)."""
    speedup: float | None = None
    efficiency: float | None = None
    step_time_ms: float | None = None
    step_time_spread: float | None = None
    """(Slowest - fastest) / median step time over the job's logging windows."""
    threads: int | None = None
    """Compute threads on the node: processes per node x intra-op threads per process."""
    cores: int | None = None
    predicted_step_ms: float | None = None
    """The planner's predicted step time (src/planning/step_time.py), next to the measured one."""
    predicted_peak_mb: float | None = None
    """The planner's prediction of the largest peak (src/planning/planner.py), next to the measured
    one."""
    tensor_peak_max_mb: float | None = None
    """The largest measured peak of tensor memory over the job's devices, what the planner
    predicts: on CPU MemTracker's count over the first steps and evaluation
    (`src/observe/tensor_memory.py`), on CUDA the allocator's peak."""
    peak_memory_max_mb: float | None = None
    """The largest peak over the job's devices: on CPU the process's resident memory (the
    interpreter, libraries and data included), on CUDA the allocator's."""
    peak_memory_spread_mb: float | None = None
    """Largest minus smallest peak over the job's devices: the load imbalance."""
    output_device_memory_ratio: float | None = None
    """dp, dp_criterion on 2+ GPUs: the output device's peak over the other devices' mean."""
    pipeline_bubble: float | None = None
    """pp layouts: the schedule's theoretical bubble, (p - 1) / (m + p - 1) or its interleaved
    form (`pp/costs.py`'s `schedule_bubble`)."""
    pipeline_idle: list[float] | None = None
    """pp layouts: each pp rank's measured share of a step spent waiting (`StageClock`)."""
    final_train_loss: float | None = None
    final_val_loss: float | None = None
    test_loss: float | None = None
    """The test pass's loss (trainer.test); absent from older summaries."""
    status: str = "failed"
    reason: str = ""
    flags: str = ""
    """Why the job's numbers cannot be trusted, comma-separated keys of FLAG_REASONS."""


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Directories of the sweep's jobs (they hold `.hydra/config.yaml`), in job order."""
    found = [path.parent.parent for path in sweep_dir.glob("*/.hydra/config.yaml")]
    return sorted(found, key=lambda d: (len(d.name), d.name))  # 2 before 10


def read_overrides(job_dir: Path) -> dict[str, str]:
    overrides = OmegaConf.load(hydra_file(job_dir, "overrides.yaml"))
    return dict(override.partition("=")[::2] for override in overrides)  # `~key` has no value


def swept_variants(all_overrides: list[dict[str, str]]) -> list[str]:
    """For each job, its overrides that differ across the sweep, strategy and devices left out."""
    keys = {key for overrides in all_overrides for key in overrides}
    swept = sorted(
        key
        for key in keys - set(SWEPT_BY_STRATEGY)
        if len({overrides.get(key) for overrides in all_overrides}) > 1
    )
    return [
        " ".join(f"{key}={overrides[key]}" for key in swept if key in overrides)
        for overrides in all_overrides
    ]


def read_row(job_dir: Path, variant: str) -> tuple[Row, DictConfig | None]:
    """The job's row, without the planner's predictions, and its config if it trained (the
    predictions' input)."""
    config = OmegaConf.load(hydra_file(job_dir, "config.yaml"))
    row = Row(
        job=job_dir.name,
        strategy=config.parallel.name,
        devices=config.parallel.devices * node_range(config.parallel.nodes).most,
        variant=variant,
    )
    status_path, summary_path = status_file(job_dir), summary_file(job_dir)
    if status_path.exists():
        status = json.loads(status_path.read_text())
        row.status, row.reason = status["status"], status["reason"]
    elif summary_path.exists():
        row.status = "ok"  # a job that ran without src/launch/sweep.py, e.g. from an older sweep
    else:
        row.reason = "no summary.json or status.json: the job did not finish (killed?)"
    if row.status == "ok" and summary_path.exists():
        # Figures not measured are null, or NaN in summaries written before they were null.
        fill_from_summary(row, finite_or_null(json.loads(summary_path.read_text())))
        return row, config
    return row, None


def add_predictions(rows: list[Row], configs: list[DictConfig | None]) -> None:
    """The planner's predicted step time and peak for each row with a config (one that
    trained). Jobs whose configs differ only in `parallel` are planned together, as `plan_all`
    plans a list of `parallel`s: one data set, one set of model sizes, and each device share
    traced once (planned one by one, the tests' sweeps' reports took a quarter more CPU)."""
    groups: dict[str, list[int]] = {}
    for index, config in enumerate(configs):
        if config is not None:
            rest = OmegaConf.to_container(config, resolve=False)
            del rest["parallel"]
            groups.setdefault(repr(rest), []).append(index)
    for indices in groups.values():
        figures = predicted([configs[index] for index in indices])
        for index, (step_ms, peak_mb) in zip(indices, figures, strict=True):
            rows[index].predicted_step_ms, rows[index].predicted_peak_mb = step_ms, peak_mb


def predicted(configs: list[DictConfig]) -> list[tuple[float | None, float | None]]:
    """For jobs whose configs differ only in `parallel`, the planner's predicted step time (ms)
    and peak memory per device (MB: training's or evaluation's, whichever is higher: a run's
    measured peak covers both); None for a job whose model it cannot trace (or whose config
    predates the planner). What `plan_all` shares between its plans is shared here too, but a
    job that fails leaves the others their predictions."""
    from src.components.data import build_data
    from src.config.job import job_config
    from src.planning.memory_trace import model_sizes
    from src.planning.planner import MB, plan_one

    try:
        data = build_data(configs[0].data, configs[0].seed)
        sizes = model_sizes(configs[0], data)
    except Exception:  # noqa: BLE001 - the table goes on without the predictions
        log.debug("no predictions for these jobs", exc_info=True)
        return [(None, None)] * len(configs)
    traces: dict[tuple, Any] = {}
    figures: list[tuple[float | None, float | None]] = []
    for config in configs:
        try:
            plan = plan_one(job_config(config), config.parallel, data, sizes, traces)
        except Exception:  # noqa: BLE001 - the table goes on without the prediction
            log.debug("no prediction for this job", exc_info=True)
            plan = None
        if plan is None or plan.problem is not None:
            figures.append((None, None))
        else:
            figures.append((plan.step_time_s * 1e3, plan.needed / MB))
    return figures


def fill_from_summary(row: Row, summary: dict[str, Any]) -> None:
    row.strategy = summary.get("layout", row.strategy)  # a mesh layout by its degrees
    row.world_size = summary["world_size"]
    row.samples_per_sec = summary["samples_per_sec"]
    row.tokens_per_sec = summary.get("tokens_per_sec")
    row.step_time_ms = summary["step_time_ms"]
    row.tflops_per_sec = summary.get("tflops_per_sec")
    row.mfu = summary.get("mfu")
    row.step_time_spread = summary.get("step_time_spread")  # older summaries lack these
    if "threads_per_process" in summary:
        row.threads = summary["processes_per_node"] * summary["threads_per_process"]
        row.cores = summary["cores"]
    row.final_train_loss = summary["final_train_loss"]
    row.final_val_loss = summary["final_val_loss"]
    row.test_loss = summary.get("test_loss")
    row.output_device_memory_ratio = summary.get("output_device_memory_ratio")
    if "pipeline" in summary:
        row.pipeline_bubble = summary["pipeline"]["bubble_fraction"]
        row.pipeline_idle = summary["pipeline"]["idle_fraction_per_rank"]
    tensor_memory = [mb for mb in summary.get("tensor_peak_mb", []) if mb is not None]
    if tensor_memory:  # not counted around compiled blocks; older summaries lack it
        row.tensor_peak_max_mb = max(tensor_memory)
    memory = summary["peak_memory_mb"]
    if memory:
        row.peak_memory_max_mb = max(memory)
        row.peak_memory_spread_mb = max(memory) - min(memory)


def add_speedups(rows: list[Row]) -> None:
    """Speed-up over the `single` job of the same variant, and speed-up per device."""
    baselines: dict[str, float] = {}
    for row in rows:
        if row.strategy == "single" and row.status == "ok":
            baselines.setdefault(non_parallel(row.variant), row.samples_per_sec)
    for row in rows:
        baseline = baselines.get(non_parallel(row.variant))
        if row.status == "ok" and baseline and row.samples_per_sec is not None:
            row.speedup = row.samples_per_sec / baseline
            row.efficiency = row.speedup / row.devices


def add_flags(rows: list[Row]) -> None:
    for row in rows:
        flags = []
        if row.threads is not None and row.threads > row.cores:
            flags.append("oversubscribed")
        if row.step_time_spread is not None and row.step_time_spread > NOISY_SPREAD:
            flags.append("noisy")
        if row.efficiency is not None and row.efficiency >= 1.005:  # shown as over 100%
            flags.append("efficiency > 100%")
        row.flags = ", ".join(flags)


def non_parallel(variant: str) -> str:
    return " ".join(part for part in variant.split() if not part.startswith("parallel."))


def collect(sweep_dir: Path) -> list[Row]:
    dirs = job_dirs(sweep_dir)
    variants = swept_variants([read_overrides(job_dir) for job_dir in dirs])
    read = [read_row(job_dir, variant) for job_dir, variant in zip(dirs, variants, strict=True)]
    rows = [row for row, _ in read]
    add_predictions(rows, [config for _, config in read])
    add_speedups(rows)
    add_flags(rows)
    return rows
