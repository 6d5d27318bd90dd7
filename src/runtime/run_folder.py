"""The names of everything a run (or a sweep job) writes in its folder: the one place that spells
them out. A leaf: imports nothing from the project."""

from __future__ import annotations

from pathlib import Path

SUMMARY = "summary.json"  # the finished run's figures (`training/summary.py`)
METRICS = "metrics.jsonl"  # one line per logged step, appended across resumes
STATUS = "status.json"  # a sweep job's outcome: ok / skipped / failed (`launch/sweep.py`)
CHECKPOINTS = "checkpoints"  # one folder per saved step
PROFILE_TRACE = "profile_trace.json"  # trainer.profile's trace
HYDRA = ".hydra"  # Hydra's record of the job: config.yaml and overrides.yaml
EVAL = "eval.json"  # eval.py's figures, in its own run folder
PREDICTIONS = "predictions.pt"  # eval.py predict=true: the model's outputs per sample
TOKENIZER = "tokenizer"  # the run's tokenizer (`tokenizer.load_tokenizer`), exports take its files


def summary_file(run_dir: Path) -> Path:
    return run_dir / SUMMARY


def metrics_file(run_dir: Path) -> Path:
    return run_dir / METRICS


def status_file(run_dir: Path) -> Path:
    return run_dir / STATUS


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


def profile_trace(run_dir: Path) -> Path:
    return run_dir / PROFILE_TRACE


def hydra_file(run_dir: Path, name: str) -> Path:
    """Hydra's `config.yaml` or `overrides.yaml` for the job in `run_dir`."""
    return run_dir / HYDRA / name


def eval_file(eval_dir: Path) -> Path:
    return eval_dir / EVAL


def predictions_file(eval_dir: Path) -> Path:
    return eval_dir / PREDICTIONS


def tokenizer_dir(run_dir: Path) -> Path:
    return run_dir / TOKENIZER
