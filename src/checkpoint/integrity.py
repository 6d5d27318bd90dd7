"""Whether a checkpoint's files are still the ones written: `manifest.json`, written last into the
staging folder, lists every file of the checkpoint with its size and crc32; reading checks them.

    {"files": {"checkpoint.pt": {"size": 5214, "crc32": 2775413309}, ...}}

A sharded checkpoint's files are checksummed by the ranks that wrote them (each its own shards,
rank 0 the rest), and rank 0 writes the manifest of them all. A checkpoint written before
manifests existed has none: it loads unchecked, as it always did.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path

from src.config.base import ConfigError

MANIFEST = "manifest.json"
CHUNK_BYTES = 8 << 20  # read in pieces: a checkpoint can be larger than memory
DCP_SHARD = re.compile(r"__(\d+)_")  # DCP names rank r's shard files `__<r>_<n>.distcp`


def file_entry(path: Path) -> dict[str, int]:
    """The size and crc32 of the file at `path`."""
    crc, size = 0, 0
    with path.open("rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": crc}


def file_entries(folder: Path, names: list[str]) -> dict[str, dict[str, int]]:
    return {name: file_entry(folder / name) for name in names}


def files_of_rank(staging: Path, rank: int, world_size: int) -> list[str]:
    """The files of a staged sharded checkpoint that `rank` checksums: the shards it wrote, and
    on rank 0 every file no rank's name claims (DCP's metadata, the train state)."""

    def owner(name: str) -> int:
        shard = DCP_SHARD.match(name)
        return int(shard[1]) if shard and int(shard[1]) < world_size else 0

    return sorted(path.name for path in staging.iterdir() if owner(path.name) == rank)


def write_manifest(folder: Path, files: dict[str, dict[str, int]]) -> None:
    """`manifest.json` of `files` in `folder`, flushed to disk."""
    with (folder / MANIFEST).open("w") as file:
        json.dump({"files": dict(sorted(files.items()))}, file, indent=1)
        file.flush()
        os.fsync(file.fileno())


def check_manifest(folder: Path) -> None:
    """Raise ConfigError, naming the file and what differs, unless every file the manifest of
    `folder` lists is there with its size and checksum (nothing to check without a manifest)."""
    path = folder / MANIFEST
    if not path.is_file():
        return
    try:
        listed = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as error:
        raise corrupt(folder, f"its {MANIFEST} cannot be read ({error})") from error
    for name, written in listed.items():
        file = folder / name
        if not file.is_file():
            raise corrupt(folder, f"{name} is missing")
        size = file.stat().st_size
        if size != written["size"]:
            raise corrupt(folder, f"{name} is {size} bytes, {written['size']} when written")
        crc = file_entry(file)["crc32"]
        if crc != written["crc32"]:
            raise corrupt(
                folder, f"{name} has crc32 {crc:08x}, {written['crc32']:08x} when written"
            )


def corrupt(folder: Path, what: str) -> ConfigError:
    # Worded as `store`'s errors are (for trainer.resume); other callers take the part after it.
    return ConfigError(f"trainer.resume: {folder} is corrupt: {what}")
