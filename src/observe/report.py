"""The scaling report of a sweep: one row per job, as `summary.csv`, `summary.md` and `scaling.png`.

It runs at the end of every multirun (the `ScalingReport` callback in `conf/config.yaml`) and by
hand on an existing sweep directory, to rebuild the table and the plot:

    python -m src.observe.report outputs/multirun/2026-05-09/12-00-00-000000

The rows are read from the jobs' folders by `src/observe/sweep_rows.py`, and the plot drawn by
`src/observe/scaling_plot.py`. Numbers that cannot be trusted are flagged in the table and the
plot, with the reason under the table. The sweep exits non-zero when a job failed, or when no job
could run at all; a combination that cannot run is reported as skipped and is not an error.

At the end of a multirun with `logger=wandb`, one more W&B run in the sweep's group, named
`scaling-report`, holds the table and the plot (a rebuild by hand logs nothing).

matplotlib is imported only to draw the plot (training never pays for it); without it the table
is still written.
"""

from __future__ import annotations

import csv
import logging
import math
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from src.observe.scaling_plot import plot
from src.observe.sweep_rows import FLAG_REASONS, STATUSES, Row, collect, job_dirs

log = logging.getLogger(__name__)

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
    "tensor_peak_max_mb": "tensor peak MB (max)",
    "peak_memory_max_mb": "process peak MB (max)",
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
    if name in ("predicted_peak_mb", "tensor_peak_max_mb"):
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
    if not logger_cfg.wandb.enabled:
        return
    from src.observe.tracking import LOGGERS, build_tracker, tracking_group

    settings = OmegaConf.to_container(logger_cfg, resolve=True)
    settings.update(
        group=tracking_group(logger_cfg, sweep_dir), run_name=REPORT_RUN, job_type=REPORT_RUN
    )
    for name in LOGGERS:  # tables and images: W&B's alone
        settings[name]["enabled"] = name == "wandb"
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
