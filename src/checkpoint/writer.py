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

import ctypes
import errno
import logging
import math
import os
import shutil
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

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
from src.runtime.progress import PhaseProgress, size_text
from src.runtime.stopping import RunStopped

log = logging.getLogger(__name__)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointNotWritten(RunStopped):
    """A checkpoint could not be written (exit code 1); the previous one is kept."""


def fsync_dir(path: Path) -> None:
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save_file(state: dict[str, Any], path: Path, what: str) -> dict[str, int]:
    """`torch.save`, flushed to disk; the file's manifest entry (size and crc32), taken as it is
    written, which spares reading it back. A long write shows its progress in bytes, as
    `writing <what>`."""
    with (
        path.open("wb") as file,
        PhaseProgress(f"writing {what}", state_bytes(state), size_text) as progress,
    ):
        checksummed = ChecksummedWrites(file, progress.advance)
        torch.save(state, checksummed)
        file.flush()
        os.fsync(file.fileno())
    return checksummed.entry()


class ChecksummedWrites:
    """A file to write, that keeps the size and crc32 of what is written to it, and tells
    `written` the bytes of each write."""

    def __init__(self, file: BinaryIO, written: Callable[[int], None]):
        self.file, self.written, self.size, self.crc = file, written, 0, 0

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        self.written(len(data))
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def entry(self) -> dict[str, int]:
        return {"size": self.size, "crc32": self.crc}


def prepare_staging(final: Path) -> Path:
    """An empty staging folder for the checkpoint `final` (a crashed try's leftovers go)."""
    staging = staging_dir(final)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, final: Path, keep: int) -> None:
    """Make the written `staging` folder the checkpoint `final` (one rename, or a swap with the
    one there), then keep only the newest `keep` step checkpoints (0: all) and drop what crashed
    writes and swaps left behind."""
    fsync_dir(staging)  # its files are synced already (`save_file`; DCP's writer by default)
    folder = final.parent
    if final.exists():  # the previous best, or a damaged checkpoint that resume skipped
        swap_in(staging, final)
    else:
        os.replace(staging, final)
    fsync_dir(folder)
    kept = saved_checkpoints(folder.parent)
    for old in kept[: -keep if keep else 0]:
        shutil.rmtree(old)
    for leftover in folder.glob(".*"):
        shutil.rmtree(leftover, ignore_errors=True)


RENAME_EXCHANGE = 2  # renameat2's flag (linux/fs.h)
AT_FDCWD = -100  # paths relative to the working directory (fcntl.h)


def swap_in(new: Path, old: Path) -> None:
    """Put the folder `new` where the folder `old` is. Linux's renameat2(RENAME_EXCHANGE) swaps
    the two names in one step (ext4, xfs, btrfs, tmpfs), so `old`'s path always names a complete
    folder, and `new`'s then holds the old one, which `publish` drops; where the system or the
    file system cannot swap, `old` is moved aside first (until the second rename, no folder has
    its name)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a C library without it
        renameat2 = None
    if renameat2 is not None:
        swapped = renameat2(AT_FDCWD, os.fsencode(new), AT_FDCWD, os.fsencode(old), RENAME_EXCHANGE)
        if swapped == 0:
            return
    aside = old.parent / f".replaced-{old.name}"
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(old, aside)
    os.replace(new, old)


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


def link_or_copy(source: str, target: str) -> None:
    """A hard link to `source` at `target`; a copy, flushed to disk, where the file system
    refuses links."""
    try:
        os.link(source, target)
    except OSError as refused:
        if refused.errno in NO_SPACE:
            raise
        shutil.copyfile(source, target)
        with open(target, "rb") as file:
            os.fsync(file.fileno())


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


def state_bytes(state: Any) -> int:
    """About how many bytes the tensors of `state` (nested dicts and lists) take on disk, whole:
    a shard of a sharded tensor counts as the tensor it is part of."""
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    if isinstance(state, torch.Tensor):
        shape = getattr(state, "global_shape", state.shape)  # `rows_placed`'s pieces
        return math.prod(shape) * state.element_size()
    return 0
