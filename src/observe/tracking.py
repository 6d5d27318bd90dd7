"""Experiment tracking: a W&B run on the main process, or nothing.

`wandb` is imported only when a W&B run is asked for, so `logger=none` starts fast. A tracker
never stops training: if W&B cannot start or fails later, one warning is logged and the run goes
on without it. An online run whose server cannot be reached becomes an offline run in the run
directory (one warning), so that nothing is lost: `wandb sync` uploads it later.
"""

from __future__ import annotations

import logging
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from src.config.base import ConfigError, first_line

log = logging.getLogger(__name__)

SERVER_MODES = ("online", "shared")
# How long to wait for the W&B server to answer at all before logging offline instead. W&B itself
# retries an unreachable server until `logger.init_timeout_s` (over a minute in all).
REACH_TIMEOUT_S = 5.0


class Tracker(Protocol):
    """Where a run's figures go (W&B, or nothing): what the trainer calls."""

    run_id: str | None  # the run a resumed run continues

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None: ...

    def log_image(self, key: str, path: Path) -> None: ...

    def save(self, path: Path) -> None: ...

    def log_model(self, folder: Path, metadata: dict[str, Any]) -> None: ...

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None: ...


def check_tracker(cfg: Any) -> None:
    """Settings that W&B would only reject once training starts (where it must not fail)."""
    if cfg.name not in ("none", "wandb"):
        raise ConfigError(f"unknown logger.name {cfg.name!r}; use logger=wandb or logger=none")


def wandb_group(logger_cfg: Any, folder: Path | str) -> str:
    """The W&B group of runs that belong together: `logger.group` when set, else the folder they
    share (a sweep's for its jobs; a run's own for the run and `eval.py`'s runs of it)."""
    return logger_cfg.group if logger_cfg.group is not None else str(folder)


class NullTracker:
    run_id: str | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        pass

    def log_image(self, key: str, path: Path) -> None:
        pass

    def save(self, path: Path) -> None:
        pass

    def log_model(self, folder: Path, metadata: dict[str, Any]) -> None:
        pass

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        pass


class WandbTracker:
    """A W&B run whose files live in `<run_dir>/wandb`."""

    def __init__(self, cfg: Any, run_dir: str, config: dict[str, Any], resume_id: str | None):
        import wandb

        self._wandb = wandb
        self._cfg, self._run_dir, self._config, self._resume_id = cfg, run_dir, config, resume_id
        mode = os.environ.get("WANDB_MODE", str(cfg.mode))
        self.run = self._start_or_go_offline(mode) if mode in SERVER_MODES else self._start(mode)
        if self.run.settings.mode == "offline":
            sync_dir = self.run.settings.sync_dir
            log.info("W&B offline run; upload it with: wandb sync %s", sync_dir)
        self.run_id = self.run.id

    def _start(self, mode: str) -> Any:
        cfg, wandb = self._cfg, self._wandb
        return wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group,
            name=cfg.run_name,
            tags=list(cfg.tags),
            job_type=cfg.job_type,
            config=self._config,
            dir=self._run_dir,
            mode=mode,
            id=self._resume_id,
            resume="allow" if self._resume_id else None,
            # Offline, W&B has nothing to say that the line above does not; online, its link.
            settings=wandb.Settings(
                init_timeout=cfg.init_timeout_s, silent=mode == "offline", quiet=True
            ),
        )

    def _start_or_go_offline(self, mode: str) -> Any:
        """An online run; an offline one, with one warning, if the server does not answer or the
        online run cannot start."""
        server = self._wandb.setup().settings.base_url
        problem = unreachable(server, REACH_TIMEOUT_S)
        if problem is None:
            try:
                return self._start(mode)
            except Exception as error:  # noqa: BLE001 - whatever it was, offline still works
                problem = first_line(error) or type(error).__name__
        log.warning(
            "W&B server %s cannot be reached (%s): logging to an offline run instead",
            server,
            problem,
        )
        return self._start("offline")

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log(metrics, step=step)
        except Exception as error:  # noqa: BLE001 - tracking must never stop training
            log.warning("W&B logging failed, continuing without it: %s", error)
            self.run = None

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        """`rows` as a `wandb.Table` under `key`, at step 0."""
        self._log_media(key, lambda: self._wandb.Table(columns=columns, data=rows))

    def log_image(self, key: str, path: Path) -> None:
        """The image file `path` (a PNG, say) under `key`, at step 0."""
        if path.exists():
            self._log_media(key, lambda: self._wandb.Image(str(path)))

    def _log_media(self, key: str, make: Callable[[], Any]) -> None:
        if self.run is None:
            return
        try:
            self.run.log({key: make()}, step=0)
        except Exception as error:  # noqa: BLE001 - tracking must never fail its caller
            log.warning("W&B could not log %s: %s", key, error)

    def save(self, path: Path) -> None:
        """Upload `path` (a file of the run folder) with the run's files."""
        if self.run is None or not path.exists():
            return
        try:
            self.run.save(str(path), base_path=str(path.parent), policy="now")
        except Exception as error:  # noqa: BLE001 - tracking must never stop training
            log.warning("W&B could not save %s: %s", path.name, error)

    def log_model(self, folder: Path, metadata: dict[str, Any]) -> None:
        """With `logger.log_checkpoints`, the checkpoint `folder` (any format) as the run's
        model artifact `model-<run id>`, aliased `best` (offline: kept to upload with the run)."""
        if self.run is None or not self._cfg.log_checkpoints or not folder.is_dir():
            return
        try:
            artifact = self._wandb.Artifact(f"model-{self.run.id}", "model", metadata=metadata)
            artifact.add_dir(str(folder))
            self.run.log_artifact(artifact, aliases=[folder.name])
        except Exception as error:  # noqa: BLE001 - tracking must never stop training
            log.warning("W&B could not log the checkpoint %s: %s", folder, error)

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        if self.run is None:
            return
        try:
            if summary:
                self.run.summary.update(summary)
            self.run.finish(exit_code=exit_code)
        except Exception as error:  # noqa: BLE001
            log.warning("W&B could not finish the run: %s", error)


def unreachable(url: str, timeout_s: float) -> str | None:
    """Why nothing answers at `url` within `timeout_s` (refused, no such host, no route, timed
    out), or None when a server answers, whatever its answer (an error status, or a certificate
    this check does not trust: W&B itself judges those)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as error:
        return None if isinstance(error.reason, ssl.SSLError) else str(error.reason)
    except OSError as error:  # e.g. a timeout while reading the answer
        return str(error) or type(error).__name__


def build_tracker(
    cfg: Any, run_dir: str, config: dict[str, Any], is_main: bool, resume_id: str | None = None
) -> Tracker:
    if not is_main or cfg.name == "none":
        return NullTracker()
    try:
        return WandbTracker(cfg, run_dir, config, resume_id)
    except Exception as error:  # noqa: BLE001 - no network or a bad key must not stop training
        log.warning("W&B could not start (%s); training continues without tracking", error)
        return NullTracker()
