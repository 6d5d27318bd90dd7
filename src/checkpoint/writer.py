"""Writing checkpoints: staged in `.staging-<name>/`, published by one rename (or swap) once every
rank has written its part, with a manifest of every file's size and checksum written last
(`integrity.py`). See `store.py` for the layout.

A write that fails for want of storage (a full disk, a quota, a file system that fails) loses
nothing: every rank learns of it (one exchange after each part that some rank writes alone), the
staging folder goes, the previous checkpoint stays as it was, and every rank together either ends
the run (`CheckpointNotWritten`, one line) or, with `trainer.checkpoint_errors=warn`, logs one
warning and trains on (the next checkpoint tries again). An asynchronous save's failure surfaces
at the next `save` or `wait` (at the latest, the end of the run), by the same rules.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from src.checkpoint.durable import (
    NO_SPACE,
    link_or_copy,
    publish,
    save_file,
    state_bytes,
)
from src.checkpoint.integrity import file_entries, files_of_rank, write_manifest
from src.checkpoint.store import (
    FULL_FILE,
    TRAIN_STATE_FILE,
    CheckpointedStrategy,
    best_dir,
    saved_checkpoints,
    staging_dir,
    step_dir,
)
from src.runtime.progress import size_text
from src.runtime.stopping import RunStopped

log = logging.getLogger(__name__)


class CheckpointNotWritten(RunStopped):
    """A checkpoint could not be written (exit code 1); the previous one is kept."""


def prepare_staging(final: Path) -> Path:
    """An empty staging folder for the checkpoint `final` (a crashed try's leftovers go)."""
    staging = staging_dir(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def resolved_format(requested: str, strategy: CheckpointedStrategy) -> str:
    """trainer.checkpoint_format, `auto` meaning the strategy's default."""
    return strategy.default_checkpoint_format if requested == "auto" else requested


class CheckpointWriter:
    """Writes a run's checkpoints; every process calls `save` (and `wait`) at the same step.

    Beside the optimizer's state, the checkpoint holds each of `states` (optimizers' states by
    their key there: the weight average's, `ema`), as it holds the optimizer's.
    `full`: the strategy gathers the state on the main process, which writes it. `sharded`:
    every rank writes its own shards through DCP, none holds the whole model; with `use_async`,
    DCP copies the state to host memory and writes it in a background thread while training
    goes on (over a process group of its own, so its collectives never meet the training's), and
    the checkpoint is published once written, at the next `save` or `wait`. `on_error`
    (trainer.checkpoint_errors): `fail` ends the run when a checkpoint cannot be written, `warn`
    trains on without it."""

    def __init__(
        self,
        run_dir: Path,
        strategy: CheckpointedStrategy,
        fmt: str,
        keep: int,
        use_async: bool,
        on_error: str = "fail",
        states: dict[str, torch.optim.Optimizer] | None = None,
    ):
        self.run_dir, self.strategy, self.keep = run_dir, strategy, keep
        self.states = states or {}
        self.sharded = fmt == "sharded"
        self.use_async = use_async and self.sharded
        self.warn = on_error == "warn"
        self.group = None
        if self.use_async and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")
        self.pending: tuple[Future, Path, int] | None = None  # an async save: its folder, size
        self.best_step: int | None = None  # the step whose state best/ holds, written here

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        best: bool = False,
    ) -> Path | None:
        """Checkpoint `model` and `optimizer` with `extra` (step, rng, config, tracker_run_ids) as
        the step's checkpoint, or with `best` as the best one; returns the folder it is (or,
        saved asynchronously, will be) published as, or None if it could not be written."""
        self.wait()
        strategy = self.strategy
        if not best and extra["step"] == self.best_step:
            return self.link_best(extra["step"])
        if best:
            self.best_step = extra["step"]
        final = best_dir(self.run_dir) if best else step_dir(self.run_dir, extra["step"])
        if not self.sharded:
            state = {
                "model": strategy.model_state_dict(model),
                "optimizer": strategy.optimizer_state_dict(model, optimizer),
                **{
                    key: strategy.optimizer_state_dict(model, held)
                    for key, held in self.states.items()
                },
                **extra,
            }

            def write() -> None:
                if strategy.is_main:
                    staging = prepare_staging(final)
                    entry = save_file(state, staging / FULL_FILE, f"checkpoint {final.name}")
                    write_manifest(staging, {FULL_FILE: entry})
                    publish(staging, final, self.keep)

            return final if self.on_every_rank(write, final, state_bytes(state)) else None
        import torch.distributed.checkpoint as dcp  # slow to import; only sharded ones need it
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        from src.checkpoint.sharded_progress import SavePlannerShowingProgress

        state = strategy.sharded_state_dict(model, optimizer)
        for key, held in self.states.items():
            state[key] = strategy.sharded_state_dict(model, held)["optimizer"]
        size = state_bytes(state) + state_bytes(extra)
        # Tensors every rank holds (FSDP's buffers, a replica's weights) are written by rank 0,
        # in its order: the checkpoint then reads back in single's key order, not with the
        # buffers another rank wrote listed last.
        dedup = {"dedup_save_to_lowest_rank": True}
        staging = staging_dir(final)

        def write_train_state() -> None:
            if strategy.is_main:
                folder = prepare_staging(final)
                save_file(extra, folder / TRAIN_STATE_FILE, f"{final.name}'s train state")

        # Then the staging folder is ready for every rank's shards.
        if not self.on_every_rank(write_train_state, final, size):
            return None
        if self.use_async:
            future = dcp.async_save(
                state,
                checkpoint_id=staging,
                process_group=self.group,
                planner=DefaultSavePlanner(**dedup),
            )
            self.pending = (future, final, size)
            return final
        # Written in the foreground, it shows its progress (this rank's shards).
        showing = SavePlannerShowingProgress(f"writing checkpoint {final.name}", **dedup)

        def write_shards() -> None:
            dcp.save(state, checkpoint_id=staging, planner=showing)
            showing.finish()

        written = self.publish_shards(write_shards, final, size)
        return final if written else None

    def link_best(self, step: int) -> Path | None:
        """The checkpoint of `step`, whose state best/ holds already (the monitored metric
        improved at a checkpoint step): best/'s files, hard-linked into a staging folder (copied
        where the file system cannot link) and published as any checkpoint is, not written
        twice. A checkpoint's files never change once written (a new best/ is a new folder)."""
        best, final = best_dir(self.run_dir), step_dir(self.run_dir, step)

        def link() -> None:
            if self.strategy.is_main:
                staging = prepare_staging(final)
                shutil.copytree(best, staging, copy_function=link_or_copy, dirs_exist_ok=True)
                publish(staging, final, self.keep)

        size = sum(file.stat().st_size for file in best.iterdir()) if best.is_dir() else 0
        return final if self.on_every_rank(link, final, size) is not None else None

    def close(self) -> None:
        self.wait()

    def wait(self) -> bool:
        """Finish an asynchronous save: once DCP's coordinator (rank 0) has written the metadata,
        every rank has written its shards, and rank 0 publishes the checkpoint. Whether it was
        written (True too when none was in flight)."""
        if self.pending is None:
            return True
        future, final, size = self.pending
        self.pending = None
        return self.publish_shards(future.result, final, size)

    def publish_shards(self, write: Callable[[], Any], final: Path, size: int) -> bool:
        """`write()` the shards of every rank into `final`'s staging folder; each rank
        checksums its own files, and rank 0 writes the manifest of them all and publishes."""
        staging = staging_dir(final)
        rank, world_size = dist_rank_and_size()

        def write_and_checksum() -> dict[str, dict[str, int]]:
            write()
            return file_entries(staging, files_of_rank(staging, rank, world_size))

        entries = self.on_every_rank(write_and_checksum, final, size)
        if entries is None:
            return False

        def write_manifest_and_publish() -> None:
            if self.strategy.is_main:
                write_manifest(staging, {k: v for part in entries for k, v in part.items()})
                publish(staging, final, self.keep)

        return self.on_every_rank(write_manifest_and_publish, final, size) is not None

    def on_every_rank(self, work: Callable[[], Any], final: Path, size: int) -> list | None:
        """`work()` on this rank (some ranks may have nothing to do), then every rank learns
        how it went on all of them: their results in rank order, or, where storage failed on any
        of them, None on all (after `abandon`). Other errors are raised where they happen."""
        try:
            outcome: tuple[OSError | None, Any] = (None, work())
        except BaseException as error:  # DCP's CheckpointException is no Exception
            cause = storage_error(error)
            if cause is None:
                raise
            outcome = (cause, None)
        outcomes = gathered(outcome)
        failures = [cause for cause, _ in outcomes if cause is not None]
        if failures:
            self.abandon(final, size, failures[0])
            return None
        return [result for _, result in outcomes]

    def abandon(self, final: Path, size: int, cause: OSError) -> None:
        """The checkpoint `final` (`size`: its tensors' bytes) could not be written: its
        staging folder goes; then the run ends, or with `warn` goes on."""
        if self.strategy.is_main:
            shutil.rmtree(staging_dir(final), ignore_errors=True)
        if final == best_dir(self.run_dir):
            self.best_step = None  # best/ holds an earlier state, if any
        failure = failure_line(cause, final, size)
        saved = saved_checkpoints(self.run_dir)
        kept = f"{saved[-1].name} is kept" if saved else "there is no earlier checkpoint"
        if self.warn:
            if self.strategy.is_main:
                log.warning(
                    "%s; %s, training goes on (the next checkpoint tries again)", failure, kept
                )
            return
        raise CheckpointNotWritten(
            f"{failure}; {kept}. Free space there and resume (trainer.resume=auto), or set "
            "trainer.checkpoint_errors=warn to train on when a checkpoint fails"
        )


def gathered(value: Any) -> list[Any]:
    """`value` of every rank, in rank order (only this one's, in a process of its own)."""
    if not dist.is_initialized():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def dist_rank_and_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def storage_error(error: BaseException) -> OSError | None:
    """The OSError behind `error`, if any: raised itself, the cause or context of another
    (torch.save's RuntimeError), or one rank's failure in DCP's CheckpointException."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # CheckpointException: {rank: (error, tb)}
        if isinstance(failures, dict):
            pending += [failed[0] for failed in failures.values()]
    return None


def failure_line(cause: OSError, final: Path, size: int) -> str:
    """What went wrong writing the checkpoint `final` (`size`: its tensors' bytes), in one line (the
    space left, for a full disk, once its partial files are gone)."""
    folder = final.parent
    reason = cause.strerror or str(cause)
    if cause.errno not in NO_SPACE:
        return f"checkpoint {final.name} not written to {folder}: {reason}"
    free = shutil.disk_usage(folder).free if folder.exists() else 0
    return (
        f"checkpoint {final.name} not written: the disk is full ({reason}) in {folder}: it "
        f"needs at least {size_text(size)} (its tensors), {size_text(free)} free there"
    )
