"""The scaling report of a sweep: one row per job, as `summary.csv`, `summary.md` and `scaling.png`.

It runs at the end of every multirun (the `ScalingReport` callback in `conf/config.yaml`) and by
hand on an existing sweep directory, to rebuild the table and the plot:

    python -m src.observe.report outputs/multirun/2026-05-09/12-00-00-000000

Each job directory holds `.hydra/` (its config and overrides), `status.json` (see
`src/launch/sweep.py`) and, when it trained, `summary.json`. Speed-up is over the sweep's `single`
job (the one with the same swept settings outside `parallel`); scaling efficiency is speed-up /
devices. A mesh layout's job is named by its degrees (`fsdp2xtp2`, `tp2`, `pp2-1F1B`: its
summary.json's `layout`); a pipeline's shows its schedule's theoretical bubble beside each pp
rank's measured idle fraction. Numbers that cannot be trusted are flagged in the table and the
plot, with the reason under the table: more threads than cores, step times that disagree between
logging windows, and efficiencies over 100%. The sweep exits non-zero when a job failed, or when
no job could run at all; a combination that cannot run is reported as skipped and is not an
error.

At the end of a multirun with `logger=wandb`, one more W&B run in the sweep's group, named
`scaling-report`, holds the table and the plot (a rebuild by hand logs nothing).

matplotlib is imported only to draw the plot (training never pays for it); without it the table
is still written.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

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
    """Devices of the whole job: parallel.devices x parallel.nodes."""
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
    peak_memory_max_mb: float | None = None
    peak_memory_spread_mb: float | None = None
    """Largest minus smallest peak over the job's devices: the load imbalance."""
    output_device_memory_ratio: float | None = None
    """dp, dp_criterion on 2+ GPUs: the output device's peak over the other devices' mean."""
    pipeline_bubble: float | None = None
    """pp layouts: the schedule's theoretical bubble, (p - 1) / (m + p - 1) or its interleaved
    form (`pipeline_schedules.schedule_bubble`)."""
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


# ------------------------------------------------------------------------------- reading the jobs


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


def read_row(job_dir: Path, variant: str) -> Row:
    config = OmegaConf.load(hydra_file(job_dir, "config.yaml"))
    row = Row(
        job=job_dir.name,
        strategy=config.parallel.name,
        devices=config.parallel.devices * config.parallel.nodes,
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
        fill_from_summary(row, json.loads(summary_path.read_text()))
        row.predicted_step_ms, row.predicted_peak_mb = predicted(config)
    return row


def predicted(config: DictConfig) -> tuple[float | None, float | None]:
    """The planner's predicted step time (ms) and peak memory per device (MB: training's or
    evaluation's, whichever is higher: a run's measured peak covers both) for a job's config;
    None when it cannot trace the model (or the config predates the planner)."""
    from src.planning.planner import MB, plan_all

    try:
        (plan,) = plan_all(config, [config.parallel])
    except Exception:  # noqa: BLE001 - the table goes on without the prediction
        log.debug("no prediction for this job", exc_info=True)
        return None, None
    if plan.problem is not None:
        return None, None
    return plan.step_time_s * 1e3, plan.needed / MB


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
        if row.status == "ok" and baseline and not math.isnan(baseline):
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
    rows = [read_row(job_dir, variant) for job_dir, variant in zip(dirs, variants, strict=True)]
    add_speedups(rows)
    add_flags(rows)
    return rows


# ------------------------------------------------------------------------------- writing the report

COLUMN_TITLES = {
    "job": "job",
    "strategy": "strategy",
    "devices": "devices",
    "variant": "variant",
    "world_size": "world size",
    "samples_per_sec": "samples/s",
    "tokens_per_sec": "tokens/s",
    "tflops_per_sec": "TFLOP/s",
    "mfu": "MFU",
    "speedup": "speed-up",
    "efficiency": "efficiency",
    "step_time_ms": "step ms",
    "predicted_step_ms": "predicted step ms",
    "step_time_spread": "step ms spread",
    "threads": "threads",
    "cores": "cores",
    "predicted_peak_mb": "predicted peak MB",
    "peak_memory_max_mb": "measured peak MB (max)",
    "peak_memory_spread_mb": "peak MB (spread)",
    "output_device_memory_ratio": "output device memory",
    "pipeline_bubble": "bubble (theory)",
    "pipeline_idle": "idle per pp rank (measured)",
    "final_train_loss": "train loss",
    "final_val_loss": "val loss",
    "test_loss": "test loss",
    "status": "status",
    "flags": "flags",
}


def rate_text(per_sec: float) -> str:
    """A rate as people read it: 3 significant digits below 100 (0.42, 12.3), whole numbers
    with thousands separators above (12,345)."""
    return f"{per_sec:.3g}" if abs(per_sec) < 100 else f"{per_sec:,.0f}"


def format_cell(name: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if name in ("speedup", "output_device_memory_ratio"):
        return f"{value:.2f}x"
    if name == "mfu":
        return f"{100 * value:.3g}%"
    if name in ("efficiency", "step_time_spread", "pipeline_bubble"):
        return f"{100 * value:.0f}%"
    if name == "pipeline_idle":
        return ", ".join("" if share is None else f"{100 * share:.0f}%" for share in value)
    if name in ("samples_per_sec", "tokens_per_sec"):
        return rate_text(value)
    if name in ("peak_memory_max_mb", "peak_memory_spread_mb"):
        return f"{value:,.0f}"
    if name == "predicted_peak_mb":
        return f"{value:,.3g}"
    if name in ("step_time_ms", "predicted_step_ms", "tflops_per_sec"):
        return f"{value:.3g}"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def markdown_table(rows: list[Row]) -> str:
    """The table with the reason folded into the status (`skipped: ...`)."""
    # Columns that only some sweeps fill (a swept variant, token sequences, dp's output device on
    # GPUs, pipelines).
    optional = {
        "variant",
        "tokens_per_sec",
        "test_loss",
        "output_device_memory_ratio",
        "pipeline_bubble",
        "pipeline_idle",
    }
    names = [n for n in COLUMN_TITLES if n not in optional or any(getattr(r, n) for r in rows)]
    align = ["---" if n in ("strategy", "variant", "status", "flags") else "---:" for n in names]
    lines = [
        "| " + " | ".join(COLUMN_TITLES[n] for n in names) + " |",
        "|" + "|".join(align) + "|",
    ]
    for row in rows:
        cells = asdict(row)
        cells["status"] = f"{row.status}: {row.reason}" if row.reason else row.status
        line = " | ".join(format_cell(n, cells[n]).replace("|", "\\|") for n in names)
        lines.append(f"| {line} |")
    return "\n".join(lines)


def flag_notes(rows: list[Row]) -> str:
    """One line per flag that occurs: the jobs it marks and why their numbers are suspect."""
    notes = []
    for flag, reason in FLAG_REASONS.items():
        jobs = [row.job for row in rows if flag in row.flags.split(", ")]
        if jobs:
            notes.append(f"- **{flag}** (jobs {', '.join(jobs)}): {reason}")
    return "\n".join(notes)


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[f.name for f in fields(Row)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def scaling_figure(rows: list[Row], title: str) -> Any:
    """Throughput and scaling efficiency against device count, one line per strategy; flagged
    jobs ringed in red. The legend sits outside both plots, where it hides no point."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, Agg renders the file

    figure = Figure(figsize=(12, 4.2), layout="constrained")
    throughput, efficiency = figure.subplots(1, 2)
    for label, points in strategy_lines(rows).items():
        devices = [row.devices for row in points]
        throughput.plot(devices, [row.samples_per_sec for row in points], "o-", label=label)
        if any(row.efficiency is not None for row in points):
            efficiency.plot(devices, [row.efficiency for row in points], "o-", label=label)
    efficiency.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="ideal")
    ring_flagged([row for row in rows if row.flags], throughput, efficiency)
    label_axes(throughput, efficiency, sorted({row.devices for row in rows}))
    handles, labels = both_legends(throughput, efficiency)
    figure.legend(handles, labels, loc="outside right upper", fontsize="small")
    figure.suptitle(title, fontsize="small")
    return figure


def strategy_lines(rows: list[Row]) -> dict[str, list[Row]]:
    """The jobs that ran, by line (strategy and variant), each line's in device order."""
    lines: dict[str, list[Row]] = {}
    for row in rows:
        if row.status == "ok":
            label = f"{row.strategy} {row.variant}".strip()
            lines.setdefault(label, []).append(row)
    for points in lines.values():
        points.sort(key=lambda row: row.devices)
    return lines


def ring_flagged(flagged: list[Row], throughput: Any, efficiency: Any) -> None:
    """A red ring around each flagged job's points."""
    for axes, value in ((throughput, "samples_per_sec"), (efficiency, "efficiency")):
        marked = [row for row in flagged if getattr(row, value) is not None]
        if not marked:
            continue
        axes.scatter(
            [row.devices for row in marked],
            [getattr(row, value) for row in marked],
            s=160,
            facecolors="none",
            edgecolors="red",
            linewidths=1.5,
            zorder=3,
            label="flagged: see summary.md",
        )


def label_axes(throughput: Any, efficiency: Any, all_devices: list[int]) -> None:
    for axes, ylabel in ((throughput, "samples/s"), (efficiency, "speed-up / devices")):
        axes.set_xlabel("devices")
        axes.set_ylabel(ylabel)
        axes.set_xticks(all_devices)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
    throughput.set_title("throughput")
    efficiency.set_title("scaling efficiency (vs single)")


def both_legends(throughput: Any, efficiency: Any) -> tuple[list, list[str]]:
    """The efficiency plot's legend entries, then the throughput plot's that it lacks."""
    handles, labels = efficiency.get_legend_handles_labels()
    known = set(labels)
    for handle, label in zip(*throughput.get_legend_handles_labels(), strict=True):
        if label not in known:  # a strategy without efficiencies (no single job to compare)
            handles.append(handle)
            labels.append(label)
    return handles, labels


def plot(rows: list[Row], path: Path, title: str) -> None:
    scaling_figure(rows, title).savefig(path, dpi=110)


def write_report(sweep_dir: Path) -> list[Row]:
    """Write summary.csv, summary.md and scaling.png into the sweep directory; print the table."""
    rows = collect(sweep_dir)
    table = markdown_table(rows)
    notes = flag_notes(rows)
    if notes:
        table += f"\n\nFlagged numbers cannot be trusted:\n\n{notes}"
    write_csv(rows, sweep_dir / "summary.csv")
    (sweep_dir / "summary.md").write_text(f"# Sweep {sweep_dir}\n\n{table}\n")
    try:
        plot(rows, sweep_dir / "scaling.png", str(sweep_dir))
    except ImportError:
        log.warning("matplotlib is not installed: no scaling.png (pip install matplotlib)")
    print(f"\nScaling report for {sweep_dir} (summary.csv, summary.md, scaling.png):\n{table}\n")
    return rows


def failure_message(rows: list[Row]) -> str | None:
    """Why the sweep should exit non-zero, or None."""
    failed = [row.job for row in rows if row.status == "failed"]
    if failed:
        jobs = ", ".join(failed)
        return f"{len(failed)} of {len(rows)} jobs failed (jobs {jobs}); see their train.log"
    if not any(row.status == "ok" for row in rows):
        return "no job of the sweep could run"
    return None


REPORT_RUN = "scaling-report"  # the W&B name and job type of a sweep's report run


def log_to_wandb(logger_cfg: DictConfig, sweep_dir: Path, rows: list[Row]) -> None:
    """One run in the sweep's W&B group (with `logger=wandb`) holding the table, as a
    `wandb.Table` with summary.csv's columns, and scaling.png. Offline it is a run file in
    `<sweep dir>/wandb`, which `wandb sync` uploads like the jobs' runs; W&B never fails the
    sweep (see src/observe/tracking.py)."""
    if logger_cfg.name != "wandb":
        return
    from src.observe.tracking import build_tracker, wandb_group  # W&B only when asked for

    settings = OmegaConf.to_container(logger_cfg, resolve=True)
    settings.update(
        group=wandb_group(logger_cfg, sweep_dir), run_name=REPORT_RUN, job_type=REPORT_RUN
    )
    counts = {status: sum(row.status == status for row in rows) for status in STATUSES}
    tracker = build_tracker(
        OmegaConf.create(settings), str(sweep_dir), {"sweep_dir": str(sweep_dir)}, is_main=True
    )
    columns = [field.name for field in fields(Row)]
    tracker.log_table("scaling/table", columns, [list(asdict(row).values()) for row in rows])
    tracker.log_image("scaling/plot", sweep_dir / "scaling.png")
    tracker.finish({f"jobs_{status}": count for status, count in counts.items()})


def check_sweep_dir(config: DictConfig) -> None:
    """A sweep folder that a multirun has written is resumed only by the command that wrote it
    (`src/launch/sweep.py`): job N of another command is another job. Hydra numbers the trials of
    other sweepers (Optuna) from 0 in every run, so only Hydra's basic sweeper resumes a folder."""
    sweep_dir = Path(config.hydra.sweep.dir)
    earlier_file = sweep_dir / "multirun.yaml"  # the basic sweeper's record of its command
    if not (earlier_file.exists() or job_dirs(sweep_dir)):
        return
    if config.hydra.sweeper._target_ != BASIC_SWEEPER:
        refuse(
            f"hydra.sweep.dir={sweep_dir} holds an earlier multirun, and this sweeper numbers "
            "its jobs from 0 in every run: choose a new hydra.sweep.dir (a study in a storage "
            "file resumes there)"
        )
    earlier = OmegaConf.load(earlier_file).hydra if earlier_file.exists() else None
    if earlier is None or any(
        as_written(earlier, key) != as_written(config.hydra, key)
        for key in ("overrides.task", "sweeper")
    ):
        command = " ".join(map(str, earlier.overrides.task)) if earlier else "another sweeper"
        refuse(
            f"hydra.sweep.dir={sweep_dir} holds the jobs of another command ({command}): "
            "run that command again to resume them, or choose a new hydra.sweep.dir"
        )


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def as_written(hydra_cfg: DictConfig, key: str) -> Any:
    return OmegaConf.to_container(OmegaConf.select(hydra_cfg, key), resolve=False)


def refuse(message: str) -> None:
    print(f"train.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class ScalingReport(Callback):
    """Hydra callback: a check that a sweep folder given again is this sweep's (before any job
    starts), the report at the end of a multirun (also to W&B), and a non-zero exit if a job
    failed."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_sweep_dir(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_report(sweep_dir)
        log_to_wandb(config.logger, sweep_dir, rows)
        message = failure_message(rows)
        if message:
            # Hydra turns an exception raised by a callback into a warning; SystemExit is the one
            # way to make the multirun's exit status say that something failed.
            raise SystemExit(f"sweep: {message}")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m src.observe.report <sweep dir>", file=sys.stderr)
        return 2
    sweep_dir = Path(argv[0])
    if not job_dirs(sweep_dir):
        print(f"{sweep_dir} holds no job directories (*/.hydra/config.yaml)", file=sys.stderr)
        return 2
    rows = write_report(sweep_dir)
    message = failure_message(rows)
    if message:
        print(f"sweep: {message}", file=sys.stderr)
    return 1 if message else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
