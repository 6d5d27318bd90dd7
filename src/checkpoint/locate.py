"""Which checkpoint `eval.py`'s `ckpt_path` names, checked to be complete before any work.

ckpt_path=<run folder>          its newest checkpoints/step-*
ckpt_path=<checkpoint folder>   checkpoints/step-*, checkpoints/best, or a copy of one
ckpt_path=best | last           checkpoints/best, or the newest checkpoints/step-*, of the
                                run in `run_dir` (default: the newest run in outputs/)
ckpt_path=<weights file>        an export (.safetensors, with the model's config; .pt)
"""

from __future__ import annotations

from pathlib import Path

from src.checkpoint.export import weights_config
from src.checkpoint.store import (
    DCP_METADATA,
    FULL_FILE,
    TRAIN_STATE_FILE,
    check_intact,
    load_checkpoint,
    saved_checkpoints,
)
from src.config.base import ConfigError
from src.runtime.run_folder import HYDRA, checkpoints_dir

BEST = "best"  # checkpoints/best: the best checkpoint's folder, in either format
LAST = "last"
RUNS = Path("outputs")  # where train.py's runs land by default (conf/config.yaml)


def named_checkpoint(ckpt_path: str, run_dir: str | None) -> Path:
    """The complete checkpoint folder (absolute) that `ckpt_path` names; else a ConfigError."""
    if ckpt_path in (BEST, LAST):
        run = Path(run_dir).expanduser() if run_dir is not None else newest_run(RUNS)
        if not checkpoints_dir(run).is_dir():
            raise ConfigError(f"ckpt_path={ckpt_path}: {run} is not a run folder with checkpoints")
        path = checkpoints_dir(run) / BEST if ckpt_path == BEST else newest_step(run)
    else:
        path = Path(ckpt_path).expanduser()
        if path.is_dir() and checkpoints_dir(path).is_dir():  # a run folder
            path = newest_step(path)
        if path.name == FULL_FILE:  # a full checkpoint's file: its folder
            path = path.parent
        if path.is_file():  # an exported weights file, read (and checked) by load_weights
            return path.resolve()
    check_complete(path)
    return path.resolve()


def newest_run(runs: Path) -> Path:
    """The newest of train.py's run folders in `runs` (`<date>/<time>`, which sort by name)
    that has written a checkpoint."""
    found = sorted(
        folder
        for folder in runs.glob("*/*")
        if (folder / HYDRA).is_dir() and checkpoints_dir(folder).is_dir()
    )
    if not found:
        raise ConfigError(
            f"ckpt_path: no run with checkpoints in {runs}/; give run_dir=<the run folder>"
        )
    return found[-1]


def newest_step(run: Path) -> Path:
    saved = saved_checkpoints(run)
    if not saved:
        raise ConfigError(f"ckpt_path: {run} has no checkpoints/step-* yet")
    return saved[-1]


def check_complete(path: Path) -> None:
    """`path` is a checkpoint folder with every file it needs, readable."""
    if path.name.startswith("."):
        raise ConfigError(
            f"ckpt_path: {path} is a checkpoint still being written, or one a crash left "
            "unfinished; give a complete one (checkpoints/step-*)"
        )
    if not path.is_dir():
        raise ConfigError(f"ckpt_path: no checkpoint folder at {path}")
    if not ((path / FULL_FILE).is_file() or (path / DCP_METADATA).is_file()):
        raise ConfigError(
            f"ckpt_path: {path} holds no checkpoint ({FULL_FILE}, or {DCP_METADATA} with "
            f"{TRAIN_STATE_FILE}); give a run folder or a checkpoint folder"
        )
    try:
        check_intact(path)
    except ConfigError as error:
        reason = str(error).removeprefix("trainer.resume: ").split("; ")[0]
        raise ConfigError(f"ckpt_path: {reason}; give a complete checkpoint") from None


def saved_config(path: Path) -> dict:
    """The resolved config the checkpoint at `path` was trained with (structure only read); of a
    weights file, its model group where it has one (a .safetensors export), else nothing."""
    if path.is_file():
        model = weights_config(path)
        return {} if model is None else {"model": model["model"]}
    return load_checkpoint(path, mmap=True)["config"]
