"""How the template writes files that people and other programs read: JSON that every JSON
reader takes, and files replaced whole, readable as the umask allows. A leaf: imports nothing from
the project."""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def json_text(value: Any, indent: int | None = None) -> str:
    """`value` as JSON, each NaN or infinity as null: Python writes them as `NaN` and `Infinity`,
    which are not JSON, and `jq`, JavaScript's `JSON.parse` and many dashboards reject the file."""
    return json.dumps(finite_or_null(value), indent=indent, allow_nan=False)


def finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float in it (in lists and dicts too) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def new_file_mode(folder: Path) -> int:
    """The mode a file created in `folder` gets (0666 less the umask: 0644 under 0022), probed
    with a file: os.umask cannot be read without setting it, which would race other threads."""
    probe = folder / f".mode-probe.{os.getpid()}.{threading.get_ident()}"
    probe.touch()
    try:
        return probe.stat().st_mode & 0o777
    finally:
        probe.unlink()


def write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """`write(path)` into a file beside `target`, then renamed onto it: readers find the old file
    or the whole new one, never half of one. The file gets `new_file_mode`, so that a colleague
    can read it, also where `write` puts a file of its own in its place (safetensors renames an
    owner-only temporary file onto it)."""
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    staging.unlink(missing_ok=True)  # left by a process of this pid that was killed
    mode = new_file_mode(target.parent)
    try:
        write(staging)
        staging.chmod(mode)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)


def readable_as_umask_allows(folder: Path) -> None:
    """Give every file in `folder` `new_file_mode`, as `write_atomically` does: a library's
    writer may leave its files owner-only (safetensors)."""
    mode = new_file_mode(folder)
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(mode)
