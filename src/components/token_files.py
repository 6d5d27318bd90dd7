"""Token files, and the windows a language model trains on, read across them.

A token file is either flat token ids (nanoGPT's `train.bin`: uint16, no header), or one of llm.c's
shards (fineweb's): a header of 256 int32 (magic, version, token count, the rest 0), then the
tokens, uint16 at version 1 and uint32 at version 2. Many files read as one sequence, in order; a
split is a list of ranges of it (rows: file index, first token, token count).
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

SHARD_MAGIC = 20240520  # llm.c's
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
DTYPE_OF_VERSION = {1: np.dtype(np.uint16), 2: np.dtype(np.uint32)}
VERSION_OF_DTYPE = {dtype: version for version, dtype in DTYPE_OF_VERSION.items()}
GLOB_CHARACTERS = frozenset("*?[")


@dataclass(frozen=True)
class TokenFile:
    path: Path
    dtype: np.dtype
    offset: int
    """Bytes before the first token: a shard's header."""
    count: int
    """Tokens in the file."""

    def tokens(self) -> np.ndarray:
        if self.count == 0:  # numpy cannot map an empty file
            return np.empty(0, self.dtype)
        return np.memmap(self.path, self.dtype, "r", offset=self.offset, shape=(self.count,))


def read_token_file(path: Path, dtype: str) -> TokenFile:
    """`path` as an llm.c shard when it starts with a shard's header that matches its size, else
    as flat tokens of `dtype` (uint16 or uint32)."""
    size = path.stat().st_size
    if size >= HEADER_BYTES:
        magic, version, count = (int(value) for value in np.fromfile(path, np.int32, 3))
        shard_dtype = DTYPE_OF_VERSION.get(version)
        shard_size = HEADER_BYTES + count * shard_dtype.itemsize if shard_dtype else None
        if magic == SHARD_MAGIC and size == shard_size:
            return TokenFile(path, shard_dtype, HEADER_BYTES, count)
    flat = np.dtype(str(dtype))
    if size % flat.itemsize:
        raise ValueError(f"{path} holds {size} bytes, not a whole number of {flat} tokens")
    return TokenFile(path, flat, 0, size // flat.itemsize)


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """`tokens` (uint16 or uint32) as an llm.c shard: its header, then the tokens."""
    header = np.zeros(HEADER_INTS, np.int32)
    header[:3] = SHARD_MAGIC, VERSION_OF_DTYPE[tokens.dtype], len(tokens)
    with path.open("wb") as file:
        file.write(header.tobytes())
        file.write(tokens.tobytes())


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest shard dtype that holds ids below `vocab_size`."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def token_files(setting: str, path: str, dtype: str) -> list[TokenFile]:
    """The token files that `data.<setting>` names: a file, or a glob of them
    (`shards/*.bin`), in name order."""
    expanded = Path(path).expanduser()
    if GLOB_CHARACTERS.isdisjoint(path):
        if not expanded.is_file():
            raise FileNotFoundError(f"data.{setting}={path}: no such token file")
        return [read_token_file(expanded, dtype)]
    paths = sorted(Path(found) for found in glob.glob(str(expanded), recursive=True))
    files = [read_token_file(found, dtype) for found in paths if found.is_file()]
    if not files:
        raise FileNotFoundError(f"data.{setting}={path} matches no token file")
    return files


def stream_ranges(files: Sequence[TokenFile], first: int, count: int) -> np.ndarray:
    """Tokens `first` to `first + count` of the files read as one sequence, as ranges (rows:
    file index, first token, count)."""
    ends = np.cumsum([file.count for file in files])
    rows = []
    for index, (file, end) in enumerate(zip(files, ends, strict=True)):
        begin = end - file.count
        low, high = max(first, begin), min(first + count, end)
        if low < high:
            rows.append((index, low - begin, high - low))
    return np.array(rows, np.int64).reshape(-1, 3)


def merged_ranges(ranges: np.ndarray) -> np.ndarray:
    """`ranges` with each run of ranges that continue one another in a file joined into one."""
    if len(ranges) == 0:
        return ranges
    same_file = ranges[1:, 0] == ranges[:-1, 0]
    continues = same_file & (ranges[1:, 1] == ranges[:-1, 1] + ranges[:-1, 2])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    counts = np.add.reduceat(ranges[:, 2], starts)
    return np.stack([ranges[starts, 0], ranges[starts, 1], counts], axis=1)


def largest_token(files: Sequence[TokenFile]) -> int:
    """The largest token id of the files (-1 when they hold none)."""
    return max((int(file.tokens().max()) for file in files if file.count), default=-1)


class TokenWindows(Dataset):
    """Windows of `seq_len + 1` tokens of the sequence that `ranges` of `files` make: window i
    starts at its token `i * seq_len`, so together they predict every next token once; a window
    may run across ranges and files. The files are numpy memmaps, opened in each process that
    reads them (a DataLoader worker too)."""

    def __init__(self, files: Sequence[TokenFile], ranges: np.ndarray, seq_len: int):
        self.files, self.ranges, self.seq_len = list(files), ranges, seq_len
        # Where each range starts in the sequence.
        self.starts = np.concatenate(([0], np.cumsum(ranges[:, 2])))
        self.num_windows = max(0, (int(self.starts[-1]) - 1) // seq_len)
        self._tokens: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        position, end = index * self.seq_len, (index + 1) * self.seq_len + 1
        row = int(np.searchsorted(self.starts, position, side="right")) - 1
        pieces = []
        while position < end:
            file, first, count = (int(value) for value in self.ranges[row])
            begin = position - int(self.starts[row])
            taken = min(end - position, count - begin)
            pieces.append(self.file_tokens(file)[first + begin : first + begin + taken])
            position, row = position + taken, row + 1
        window = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        return window[:-1], window[1:]

    def file_tokens(self, index: int) -> np.ndarray:
        if index not in self._tokens:
            self._tokens[index] = self.files[index].tokens()
        return self._tokens[index]

    def __getstate__(self) -> dict:  # a memmap does not travel to workers; each opens its own
        return {**self.__dict__, "_tokens": {}}
