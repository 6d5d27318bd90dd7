"""Files that survive a crash: written and flushed to disk with their manifest entry (size
and crc32, taken as they are written), and folders put in place by one rename or swap."""

from __future__ import annotations

import ctypes
import errno
import math
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from src.checkpoint.store import saved_checkpoints
from src.runtime.progress import PhaseProgress, size_text

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


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
