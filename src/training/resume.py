"""Resuming: whether a checkpoint fits this run (model shapes, optimizer, steps left, the
learning-rate schedule kept), and where the run picks up."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.components.optimizer import block_matrices, grouped
from src.components.schedules import lr_schedule, schedule_length
from src.config.base import ConfigError
from src.config.job import JobConfig
from src.config.optimizer import SCHEDULES
from src.config.trainer import TrainerConfig

log = logging.getLogger(__name__)


def check_resumable(state: dict[str, Any], path: Path, model: nn.Module, job: JobConfig) -> None:
    """The checkpoint fits this run: same parameter shapes, same optimizer, steps left to do."""
    cfg, max_steps = job.cfg, job.trainer.max_steps
    saved = state["config"]
    check_same_model(
        state, path, model, "trainer.resume", "resume with those settings, or start a new run"
    )
    trained = saved["optimizer"]
    if (trained["name"], trained["_target_"]) != (cfg.optimizer.name, cfg.optimizer._target_):
        raise ConfigError(
            f"trainer.resume: {path} was trained with optimizer={trained['name']} "
            f"({trained['_target_']}); resume with the same optimizer, or start a new run"
        )
    check_same_groups(state, path, model, cfg)
    if state["step"] >= max_steps and not finished(state, job.trainer):
        raise ConfigError(
            f"trainer.resume: {path} is at step {state['step']} and trainer.max_steps="
            f"{max_steps}, so there is nothing left to train; raise trainer.max_steps"
        )
    check_schedule_kept(state, path, cfg.optimizer, max_steps)


def check_same_groups(state: dict[str, Any], path: Path, model: nn.Module, cfg: DictConfig) -> None:
    """The checkpoint's optimizer has this run's parameter groups (`optimizer.decay_1d` and
    `block_matrices_apart` split them; checkpoints of adamw from before decay_1d have one). A
    sharded checkpoint's structure, read before any rank starts, holds no optimizer groups: DCP
    checks those as it loads."""
    if not state.get("optimizer"):
        return
    saved = [len(group["params"]) for group in state["optimizer"]["param_groups"]]
    groups = grouped(cfg.optimizer, model.parameters(), block_matrices(model))
    expected = [len(group["params"]) for group in groups]
    if saved != expected:
        raise ConfigError(
            f"trainer.resume: {path}'s optimizer has parameter groups of {saved} parameters, "
            f"this run's {expected} (optimizer.decay_1d={str(cfg.optimizer.decay_1d).lower()}); "
            "resume with the decay_1d it was trained with, or start a new run from its weights "
            "with trainer.init_from"
        )


def check_same_model(
    state: dict[str, Any], path: Path, model: nn.Module, setting: str, remedy: str
) -> None:
    """The checkpoint `state` at `path` (named by `setting`) holds `model`'s parameter shapes;
    else a ConfigError naming the first that differs, the settings it was trained with, and
    `remedy`."""
    saved = state["config"]
    expected = {key: list(value.shape) for key, value in model.state_dict().items()}
    found = {key: list(value.shape) for key, value in state["model"].items()}
    if found != expected:
        key = next(
            k for k in sorted(expected.keys() | found.keys()) if expected.get(k) != found.get(k)
        )
        trained = " ".join(f"model.{k}={v}" for k, v in saved["model"].items() if k != "_target_")
        raise ConfigError(
            f"{setting}: {path} holds a different model ({key}: {found.get(key)} there, "
            f"{expected.get(key)} here); it was trained with {saved['model']['_target_']} "
            f"{trained} on {saved['data']['_target_']}: {remedy}"
        )


def check_schedule_kept(
    state: dict[str, Any], path: Path, optimizer: DictConfig, max_steps: int
) -> None:
    """A schedule decays over trainer.max_steps unless optimizer.schedule_steps says
    otherwise; resuming with another max_steps would quietly stretch or shrink it, and the
    learning rate would jump. That takes optimizer.schedule_steps, set either way."""
    saved = state["config"]
    saved_length = schedule_length(saved["optimizer"], saved["trainer"]["max_steps"])
    length = schedule_length(optimizer, max_steps)
    if optimizer.schedule_steps is not None or length == saved_length:
        return
    if optimizer.schedule not in SCHEDULES:  # a scheduler class's curve has its own length
        return
    kept, stretched = lr_schedule(optimizer, saved_length), lr_schedule(optimizer, length)
    changed = (
        step
        for step in range(state["step"], max_steps)
        if not math.isclose(kept(step), stretched(step), rel_tol=1e-9)
    )
    step = next(changed, None)
    if step is not None:
        raise ConfigError(
            f"trainer.resume: {path} was trained with a {optimizer.schedule} schedule over "
            f"{saved_length} steps; trainer.max_steps={max_steps} would rescale it to "
            f"{length} steps, changing the learning rate from step {step + 1} on "
            f"({stretched(step):.3g} instead of {kept(step):.3g}). Set optimizer.schedule_steps="
            f"{saved_length} to keep the schedule (later steps keep its final rate), or "
            f"optimizer.schedule_steps={length} to stretch it"
        )


def saved_lr(state: dict[str, Any]) -> Callable[[int], float]:
    """The learning-rate schedule a checkpoint was trained with."""
    saved = state["config"]
    return lr_schedule(OmegaConf.create(saved["optimizer"]), saved["trainer"]["max_steps"])


def finished(state: dict[str, Any], trainer: TrainerConfig) -> bool:
    """With trainer.resume=auto, the checkpoint of a run that trained all its steps or stopped
    early (killed, say, after writing it): a requeued job then ends at once, successfully."""
    done = state["step"] == trainer.max_steps or state.get("stopped_early", False)
    return trainer.resume == "auto" and done


def log_resumed_schedule(job: JobConfig, state: dict[str, Any], checkpoint: Path) -> None:
    """Where the run resumes, and its learning rate; a schedule that changed is a warning."""
    step = state["step"]
    lr = lr_schedule(job.cfg.optimizer, job.trainer.max_steps)(step)
    log.info("resuming from %s at step %d, learning rate %.3g", checkpoint, step, lr)
    planned = saved_lr(state)(step)
    if not math.isclose(lr, planned, rel_tol=1e-9):
        log.warning(
            "the learning-rate schedule differs from the checkpoint's: step %d runs at %.3g "
            "instead of %.3g",
            step + 1,
            lr,
            planned,
        )
