"""`eval.py`'s work in one process: a checkpoint's model, rebuilt and restored as `Trainer`
builds it (without an optimizer; with trainer.ema_eval, its weight average swapped in) under any
strategy and number of processes, evaluated on one split of the data. Its figures go to the
console (one line), `eval.json` in eval.py's run folder and each logger's run (W&B, MLflow, ...)
of `job_type=eval` in the training run's group; with `predict=true`, the model's outputs for
every sample to `predictions.pt` (`predictions.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn
from torch.utils.data import Dataset

from src.checkpoint.export import load_weights
from src.checkpoint.store import load_checkpoint
from src.components.batch_order import ValBatches
from src.components.data_contract import Data, Split
from src.components.precision import autocast
from src.components.state_dicts import check_weights_fit
from src.config.base import ConfigError, plain_config
from src.config.job import JobConfig
from src.observe.tracking import build_tracker, tracking_group
from src.parallel.base import Strategy
from src.runtime.files import json_text
from src.runtime.run_folder import eval_file, predictions_file
from src.training.build import (
    Blueprint,
    build_checked_parts,
    build_wrapped_model,
    checkpoint_to_load,
    set_numerics,
)
from src.training.ema import EMA, holds_average
from src.training.inputs import input_loading
from src.training.predictions import SampleOutputs
from src.training.resume import check_same_model
from src.training.step import evaluate

log = logging.getLogger(__name__)


def as_evaluated(cfg: DictConfig) -> None:
    """The run's settings (`cfg`, composed by eval.py) as evaluation takes them: it writes no
    checkpoint, so the run's checkpoint format (which another layout may not write) and resume
    are left out; its logger runs are of job_type=eval, in the training run's group."""
    cfg.trainer.checkpoint_format = "auto"
    cfg.trainer.async_checkpoint = False
    cfg.trainer.resume = None
    if "group" in cfg.logger:
        run_dir = Path(cfg.ckpt_path).parent.parent  # <run>/checkpoints/<checkpoint>
        cfg.logger.group = tracking_group(cfg.logger, run_dir)
        cfg.logger.job_type = "eval"
        cfg.logger.run_name = f"eval-{cfg.split}"
    if cfg.predict and cfg.parallel.get("loss_parallel"):
        raise ConfigError(
            "predict=true needs whole outputs, but parallel.loss_parallel=true leaves them split "
            "over the tensor-parallel ranks; set parallel.loss_parallel=false"
        )


def eval_blueprint(job: JobConfig, strategy: Strategy) -> Blueprint:
    """Data, task and the model on the meta device, checked as for training, with the split to
    evaluate and the checkpoint, which must hold this model."""
    data, task, model = build_checked_parts(job, strategy)
    named_split(data, job.cfg.split)
    return checkpoint_blueprint(job, data, task, model, "evaluate")


def checkpoint_blueprint(
    job: JobConfig, data: Data, task: Any, model: nn.Module, use: str
) -> Blueprint:
    """The blueprint of the checkpoint (or exported weights file) `ckpt_path`, checked to hold
    `model` (on the meta device) and, under trainer.ema_eval, a weight average; `use`: what the
    command does with it, for the remedy."""
    checkpoint = Path(job.cfg.ckpt_path)
    if checkpoint.is_file():  # an exported weights file: the model's tensors, no step
        saved = {"model": load_weights(checkpoint), "step": None}
        remedy = "give the model (and data=...) it was trained with"
        check_weights_fit(model, saved["model"], f"ckpt_path: {checkpoint}", True, remedy, remedy)
    else:
        saved = load_checkpoint(checkpoint, mmap=True)
        check_same_model(
            saved, checkpoint, model, "ckpt_path", f"{use} it with the run's model settings"
        )
    if job.trainer.ema_eval and not holds_average(saved):
        raise ConfigError(
            f"trainer.ema_eval=true but ckpt_path {checkpoint} holds no weight average (its run "
            "had trainer.ema_decay=null, or it is an exported file); set trainer.ema_eval=false"
        )
    return Blueprint(data, task, model, checkpoint, saved, init_from=None)


def named_split(data: Data, name: str) -> Split | Dataset:
    splits = {
        field.name: getattr(data, field.name)
        for field in dataclasses.fields(data)
        if isinstance(getattr(data, field.name), (Split, Dataset))
    }
    if name not in splits:
        raise ConfigError(f"split={name}: the data has no such split; choose {', '.join(splits)}")
    return splits[name]


def evaluate_checkpoint(
    job: JobConfig, eval_dir: Path, strategy: Strategy, blueprint: Blueprint | None = None
) -> dict[str, Any]:
    """Evaluate `ckpt_path` on `split` in this process (one of several, for multi-process
    strategies); the figures, also in eval.json. `blueprint`: the up-front build
    (`eval_blueprint`), if done already."""
    cfg = job.cfg
    blueprint = blueprint or eval_blueprint(job, strategy)
    strategy.setup()
    try:
        figures, samples = evaluate_split(job, eval_dir, strategy, blueprint)
    finally:
        strategy.teardown()
    results = {
        "checkpoint": str(blueprint.checkpoint),
        "step": blueprint.saved["step"],
        "split": cfg.split,
        "samples": samples,
        "strategy": strategy.name,
        "devices": cfg.parallel.devices,
        "world_size": strategy.data_shards,
        **figures,
        **({"predictions": predictions_file(eval_dir).name} if cfg.predict else {}),
    }
    if strategy.is_main:
        shown = " | ".join(f"{name} {value:.6g}" for name, value in figures.items())
        weights = "exported weights" if results["step"] is None else f"step {results['step']}"
        log.info("%s | %s | %s", cfg.split, weights, shown)
        eval_file(eval_dir).write_text(json_text(results, indent=2) + "\n")
    tracker = build_tracker(cfg.logger, str(eval_dir), plain_config(cfg), strategy.is_main)
    step = results["step"] or 0  # an exported weights file has none
    tracker.log({f"{cfg.split}/{name}": value for name, value in figures.items()}, step)
    tracker.finish(results, 0)
    return results


def evaluate_split(
    job: JobConfig, eval_dir: Path, strategy: Strategy, blueprint: Blueprint
) -> tuple[dict[str, float], int]:
    """The task's figures over the split (all processes together), and its number of samples;
    with `predict`, the outputs written too."""
    cfg, settings = job.cfg, job.trainer
    model = restored_model(job, strategy, blueprint)
    split = named_split(blueprint.data, cfg.split)
    batches = ValBatches(
        split,
        settings.eval_batch,
        strategy.data_shard,
        strategy.data_shards,
        input_loading(cfg, strategy),
    )
    outputs = SampleOutputs() if cfg.predict else None
    precision = autocast(strategy.device_type, settings.precision)
    figures = evaluate(
        model, strategy, blueprint.task, batches, settings.eval_batch, precision, outputs, cfg.split
    )
    if outputs is not None:
        outputs.write(strategy, predictions_file(eval_dir), len(split))
    return figures, len(split)


def restored_model(job: JobConfig, strategy: Strategy, blueprint: Blueprint) -> nn.Module:
    """The checkpoint's model, wrapped by the (set up) `strategy`, whatever layout saved it;
    holding the checkpoint's weight average under trainer.ema_eval."""
    set_numerics(job.trainer, strategy.device_type)
    state, in_shards = checkpoint_to_load(blueprint, strategy)
    model = build_wrapped_model(job, strategy, blueprint.data, None if in_shards else state)
    if in_shards:
        strategy.load_sharded(model, None, str(blueprint.checkpoint))
    if job.trainer.ema_eval:
        ema = EMA(job.trainer, strategy.trained_parameters(model))
        ema.load(strategy, model, state, blueprint.checkpoint, in_shards)
        ema.averaged.swap()  # the model keeps the average: nothing swaps it back
    return model
