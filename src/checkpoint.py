"""Checkpoints: written so that a crash never leaves a half-written file, read back to resume.

A checkpoint is one `torch.save`d dict: `model` (the plain state_dict, single's keys, whatever
the strategy), `optimizer`, `step` (optimizer steps done), `rng`, `config` (resolved) and
`wandb_run_id`. It holds only tensors and plain Python values, so it loads with
`weights_only=True`.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from src.config import ConfigError

REQUIRED_KEYS = ("model", "optimizer", "step", "rng", "config")


def checkpoint_path(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last.pt"


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write `state` to `path` so that a crash at any moment leaves the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # One writer per run folder, so a fixed name is safe, and a crash leaves no pile of leftovers.
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def resume_path(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint `trainer.resume` names: None; `auto`, the run folder's last checkpoint if
    there is one yet (so a job can be restarted with the same command); or a path."""
    if resume is None:
        return None
    if resume == "auto":
        path = checkpoint_path(run_dir)
        return path if path.exists() else None
    return Path(resume).expanduser()


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint to resume from; anything missing or unreadable is a ConfigError.

    `mmap=True` reads only the structure (shapes, step, config), for checks before any work."""
    if not path.is_file():
        raise ConfigError(
            f"trainer.resume: no checkpoint at {path}; give the path of a last.pt, or "
            "trainer.resume=auto with hydra.run.dir=<the run folder to continue>"
        )
    if not zipfile.is_zipfile(path):  # what torch.save writes; a truncated file is no zip
        raise ConfigError(
            f"trainer.resume: {path} is not a checkpoint, or it was cut short; point "
            "trainer.resume at an intact checkpoint, or leave it unset to start afresh"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - however it fails, the file is unusable
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"trainer.resume: {path} is not a readable checkpoint ({reason}); point "
            "trainer.resume at an intact checkpoint, or leave it unset to start afresh"
        ) from error
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise ConfigError(
            f"trainer.resume: {path} is not a checkpoint written by train.py (it needs "
            f"{', '.join(REQUIRED_KEYS)}); point trainer.resume at a run's checkpoints/last.pt"
        )
    return state


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
