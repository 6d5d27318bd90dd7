"""Experiment tracking: the loggers that `logger=` chose (`src/observe/loggers.py`), on the
main process only.

Each logger's library is imported only when it is chosen, so `logger=none` starts fast. A
tracker never stops training: a logger that cannot start, or fails later (a full disk, a dead
server), gives one warning and the run goes on without it (`Trackers`).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from src.config.base import ConfigError, first_line
from src.observe.loggers import (
    CsvTracker,
    MlflowTracker,
    Start,
    TensorBoardTracker,
    Tracker,
    WandbTracker,
)

log = logging.getLogger(__name__)


class Trackers:
    """The loggers chosen, each called in turn. One that raises gives one warning and is left
    out from then on: tracking must never stop training."""

    def __init__(self, trackers: dict[str, Tracker]):
        self.trackers = trackers
        # Kept after a logger fails, so that a resumed run still continues its run.
        self.run_ids = {name: t.run_id for name, t in trackers.items() if t.run_id is not None}

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                call(tracker)
            except Exception as error:  # noqa: BLE001 - whatever it was, training goes on
                message = first_line(error) or type(error).__name__
                log.warning("%s could not %s, continuing without it: %s", name, what, message)
                del self.trackers[name]

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._each("log", lambda tracker: tracker.log(metrics, step))

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self._each(f"log {key}", lambda tracker: tracker.log_table(key, columns, rows))

    def log_image(self, key: str, path: Path) -> None:
        if path.exists():
            self._each(f"log {key}", lambda tracker: tracker.log_image(key, path))

    def save(self, path: Path) -> None:
        if path.exists():
            self._each(f"save {path.name}", lambda tracker: tracker.save(path))

    def log_model(self, folder: Path, metadata: dict[str, Any]) -> None:
        if folder.is_dir():
            call = lambda tracker: tracker.log_model(folder, metadata)  # noqa: E731
            self._each(f"log the checkpoint {folder}", call)

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        self._each("finish the run", lambda tracker: tracker.finish(summary, exit_code))
        self.trackers = {}  # finished: a second finish (the trainer's exit) finds none


def chosen_loggers(cfg: Any) -> list[str]:
    """The loggers `logger=` turned on."""
    return [name for name in LOGGERS if cfg[name].enabled]


def check_tracker(cfg: Any) -> None:
    """Each chosen logger's package is installed: found now, not once training has started."""
    for name in chosen_loggers(cfg):
        package, install = LOGGERS[name][1:]
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(f"logger={name} needs {package}: pip install {install}")


def tracking_group(logger_cfg: Any, folder: Path | str) -> str:
    """The group of runs that belong together: `logger.group` when set, else the folder they
    share (a sweep's for its jobs; a run's own for the run and `eval.py`'s runs of it)."""
    return logger_cfg.group if logger_cfg.group is not None else str(folder)


def build_tracker(
    cfg: Any,
    run_dir: Path | str,
    config: dict[str, Any],
    is_main: bool,
    run_ids: dict[str, str] | None = None,
    step: int = 0,
) -> Trackers:
    """The chosen loggers (none off the main process), each continuing its run in `run_ids`
    after `step` (a resumed run's); one that cannot start is left out with one warning."""
    trackers: dict[str, Tracker] = {}
    for name in chosen_loggers(cfg) if is_main else []:
        run_id = (run_ids or {}).get(name)
        try:
            trackers[name] = LOGGERS[name][0](Start(cfg, Path(run_dir), config, run_id, step))
        except Exception as error:  # noqa: BLE001 - no network or a bad key must not stop training
            message = first_line(error) or type(error).__name__
            log.warning("%s could not start (%s); training continues without it", name, message)
    return Trackers(trackers)


# Each logger (`conf/logger/<name>.yaml`, `logger.<name>`): its tracker, and the package it needs
# with what installs it (None: the standard library's).
LOGGERS: dict[str, tuple[Callable[[Start], Tracker], str | None, str | None]] = {
    "wandb": (WandbTracker, "wandb", "wandb"),
    "tensorboard": (TensorBoardTracker, "tensorboard", "tensorboard"),
    "mlflow": (MlflowTracker, "mlflow", "mlflow-skinny"),
    "csv": (CsvTracker, None, None),
}
