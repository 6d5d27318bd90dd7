"""The loggers of `conf/logger/`, each a `Tracker`: W&B, TensorBoard, MLflow and CSV files.

Each imports its library only when it starts. None catches its own errors: `Trackers`
(`src/observe/tracking.py`) warns once and leaves a failing one out. A W&B run whose server cannot
be reached becomes an offline run in the run directory (one warning), so that nothing is lost:
`wandb sync` uploads it later.
"""

from __future__ import annotations

import csv
import logging
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from omegaconf import OmegaConf

from src.config.base import first_line
from src.runtime.files import write_atomically

log = logging.getLogger(__name__)

SERVER_MODES = ("online", "shared")
# How long to wait for the W&B server to answer at all before logging offline instead. W&B itself
# retries an unreachable server until `logger.wandb.init_timeout_s` (over a minute in all).
REACH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Start:
    """What a logger starts from."""

    cfg: Any  # `logger`: the run's name, group and tags, and each logger's own section
    run_dir: Path
    config: dict[str, Any]  # the resolved config, logged as the run's hyperparameters
    run_id: str | None  # the logger's run that a resumed run continues; None: a new one
    step: int  # the last step already logged: a continued run drops whatever came after it


class Tracker:
    """One logger: what the trainer's figures reach it through. Each method does nothing unless
    the logger has a use for it."""

    run_id: str | None = None  # what a resumed run continues (`Start.run_id`)

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        pass

    def log_image(self, key: str, path: Path) -> None:
        pass

    def save(self, path: Path) -> None:
        """Keep `path` (a file of the run folder) with the run's files."""

    def log_model(self, folder: Path, metadata: dict[str, Any]) -> None:
        pass

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        pass


class WandbTracker(Tracker):
    """A W&B run whose files live in `<run_dir>/wandb`."""

    def __init__(self, start: Start):
        import wandb

        self._wandb, self._start = wandb, start
        mode = os.environ.get("WANDB_MODE", str(start.cfg.wandb.mode))
        self.run = self._start_or_go_offline(mode) if mode in SERVER_MODES else self._init(mode)
        if self.run.settings.mode == "offline":
            sync_dir = self.run.settings.sync_dir
            log.info("W&B offline run; upload it with: wandb sync %s", sync_dir)
        self.run_id = self.run.id

    def _init(self, mode: str) -> Any:
        start, wandb = self._start, self._wandb
        cfg = start.cfg
        return wandb.init(
            project=cfg.project,
            entity=cfg.wandb.entity,
            group=cfg.group,
            name=cfg.run_name,
            tags=list(cfg.tags),
            job_type=cfg.job_type,
            config=start.config,
            dir=str(start.run_dir),
            mode=mode,
            id=start.run_id,
            resume="allow" if start.run_id else None,
            # Offline, W&B has nothing to say that the line above does not; online, its link.
            settings=wandb.Settings(
                init_timeout=cfg.wandb.init_timeout_s, silent=mode == "offline", quiet=True
            ),
        )

    def _start_or_go_offline(self, mode: str) -> Any:
        """An online run; an offline one, with one warning, if the server does not answer or the
        online run cannot start."""
        server = self._wandb.setup().settings.base_url
        problem = unreachable(server, REACH_TIMEOUT_S)
        if problem is None:
            try:
                return self._init(mode)
            except Exception as error:  # noqa: BLE001 - whatever it was, offline still works
                problem = first_line(error) or type(error).__name__
        log.warning(
            "W&B server %s cannot be reached (%s): logging to an offline run instead",
            server,
            problem,
        )
        return self._init("offline")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        """`rows` as a `wandb.Table` under `key`, at step 0."""
        self.run.log({key: self._wandb.Table(columns=columns, data=rows)}, step=0)

    def log_image(self, key: str, path: Path) -> None:
        """The image file `path` (a PNG, say) under `key`, at step 0."""
        self.run.log({key: self._wandb.Image(str(path))}, step=0)

    def save(self, path: Path) -> None:
        """Upload `path` with the run's files."""
        self.run.save(str(path), base_path=str(path.parent), policy="now")

    def log_model(self, folder: Path, metadata: dict[str, Any]) -> None:
        """With `logger.wandb.log_checkpoints`, the checkpoint `folder` (any format) as the run's
        model artifact `model-<run id>`, aliased `best` (offline: kept to upload with the run)."""
        if not self._start.cfg.wandb.log_checkpoints:
            return
        artifact = self._wandb.Artifact(f"model-{self.run.id}", "model", metadata=metadata)
        artifact.add_dir(str(folder))
        self.run.log_artifact(artifact, aliases=[folder.name])

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        if summary:
            self.run.summary.update(summary)
        self.run.finish(exit_code=exit_code)


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


class TensorBoardTracker(Tracker):
    """Event files in `logger.tensorboard.log_dir` (default `<run dir>/tensorboard`): the figures
    as scalars, the config in the HParams tab (the first run's: a resumed run writes none), and
    the summary's numbers as `summary/<key>` at the last step. A resumed run writes to the same
    folder, and TensorBoard drops whatever an earlier run logged there after `Start.step`
    (`purge_step`)."""

    def __init__(self, start: Start):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        log_dir = start.cfg.tensorboard.log_dir or start.run_dir / "tensorboard"
        self.writer = SummaryWriter(str(log_dir), purge_step=start.step + 1 if start.step else None)
        if not start.step:  # the HParams tab reads the first run's alone
            for summary in hparams(flat_config(start.config), {}):
                self.writer.file_writer.add_summary(summary)
        self.step = start.step

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.step = step

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        for key, value in numbers(summary).items():
            self.writer.add_scalar(f"summary/{key}", value, self.step)
        self.writer.close()


class MlflowTracker(Tracker):
    """A run of the MLflow experiment `logger.project` at `logger.mlflow.tracking_uri` (default:
    a file store in `<run dir>/mlruns`), named `logger.run_name` and tagged with the group, job
    type and tags: the figures as metrics, the config as params, the summary's numbers as
    `summary/<key>` metrics at the last step. A resumed run continues the same run (its id is
    in the checkpoint); the metrics an earlier run logged after `Start.step` stay."""

    BATCH = 100  # params per request: MLflow's limit

    def __init__(self, start: Start):
        cfg = start.cfg
        uri = cfg.mlflow.tracking_uri or (start.run_dir / "mlruns").resolve().as_uri()
        scheme = urllib.parse.urlparse(uri).scheme
        if scheme in ("", "file"):
            # MLflow 3 keeps its file store only for those who ask for it; it needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        elif scheme in ("http", "https") and (problem := unreachable(uri, REACH_TIMEOUT_S)):
            # MLflow itself would retry for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES).
            raise ConnectionError(f"MLflow server {uri} cannot be reached ({problem})")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self.client = Metric, MlflowClient(uri)
        if start.run_id is None:
            run = self._new_run(cfg)
        else:
            run = self.client.get_run(start.run_id)
            self.client.update_run(start.run_id, status="RUNNING")
        self.run_id, self.step = run.info.run_id, start.step
        # A param cannot change once logged: a resumed run logs only those the run lacks.
        params = [
            Param(key, str(value)[:6000])
            for key, value in flat_config(start.config).items()
            if key not in run.data.params
        ]
        for first in range(0, len(params), self.BATCH):
            self.client.log_batch(self.run_id, params=params[first : first + self.BATCH])

    def _new_run(self, cfg: Any) -> Any:
        experiment = self.client.get_experiment_by_name(cfg.project)
        if experiment is None:
            experiment_id = self.client.create_experiment(cfg.project)
        else:
            experiment_id = experiment.experiment_id
        tags = {"group": cfg.group, "job_type": cfg.job_type, "tags": ",".join(cfg.tags)}
        given = {key: str(value) for key, value in tags.items() if value}
        return self.client.create_run(experiment_id, run_name=cfg.run_name, tags=given)

    def log(self, metrics: dict[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        entries = [self._metric(key, value, now_ms, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=entries)
        self.step = step

    def save(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        if figures := numbers(summary):
            self.log({f"summary/{key}": value for key, value in figures.items()}, self.step)
        self.client.set_terminated(self.run_id, "FINISHED" if exit_code == 0 else "FAILED")


class CsvTracker(Tracker):
    """`metrics.csv` in the run folder: a `step` column and one per figure, a row for each
    record (a figure first logged later adds its column: the file is written again), and
    `hparams.yaml`, the resolved config. A resumed run drops the rows after `Start.step` first,
    as `metrics.jsonl` does."""

    def __init__(self, start: Start):
        (start.run_dir / "hparams.yaml").write_text(OmegaConf.to_yaml(start.config))
        self.path = start.run_dir / "metrics.csv"
        rows = [row for row in self._rows() if int(row["step"]) <= start.step]
        self.columns = list(rows[0]) if rows else ["step"]
        self.file = self._rewrite(rows)

    def _rows(self) -> list[dict[str, str]]:
        if not self.path.exists():
            return []
        with self.path.open(newline="") as file:
            return [row for row in csv.DictReader(file) if row["step"].isdigit()]

    def _rewrite(self, rows: list[dict[str, str]]) -> TextIO:
        """The file as `rows` under `self.columns`, opened to append."""

        def write(staging: Path) -> None:
            with staging.open("w", newline="") as file:
                writer = csv.DictWriter(file, self.columns)
                writer.writeheader()
                writer.writerows(rows)

        write_atomically(self.path, write)
        return self.path.open("a", newline="")

    def log(self, metrics: dict[str, float], step: int) -> None:
        new = [key for key in metrics if key not in self.columns]
        if new:
            self.file.close()
            self.columns += new
            self.file = self._rewrite(self._rows())
        csv.DictWriter(self.file, self.columns).writerow({"step": step, **metrics})
        self.file.flush()

    def finish(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        self.file.close()  # the summary is summary.json's, beside it


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """`config`'s settings under dotted keys (`trainer.max_steps`), as TensorBoard's and MLflow's
    hyperparameters take them: lists and None as text."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            plain = isinstance(value, (bool, int, float, str))
            flat[f"{prefix}{key}"] = value if plain else str(value)
    return flat


def numbers(summary: dict[str, Any] | None) -> dict[str, float]:
    """The summary's figures that are numbers (not flags, names or nulls)."""
    return {
        key: value
        for key, value in (summary or {}).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
