"""One process's part of an experiment before and after it trains: check the config, build on
the meta device, resume, report.

The builder runs twice per process, once on the meta device here (`build_blueprint`: data, task
and a model of shapes only, so that whatever can fail on bad input fails before any process,
device or tracker is touched), then for real (`Trainer.build`, `trainer.py`: the model, its
wrapping, optimizer and checkpoint), reusing the first's data and task. A launcher runs only the
first (`check_config`: the settings' checks, then that). Which process runs what is
`src/launch/job.py`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.checkpoint.store import (
    load_checkpoint,
    resolved_format,
    resume_path,
)
from src.components.batches import Tree, describe
from src.components.data import Data, build_data, first_samples, meta_samples
from src.components.optimizer import build_optimizer, lr_schedule, schedule_length
from src.config.schema import ConfigError, TrainerConfig, typed
from src.observe.tracking import check_tracker
from src.parallel import build_strategy
from src.parallel.base import Strategy, resolve_device_type
from src.runtime.ranks import Ranks
from src.runtime.run_folder import metrics_file, summary_file
from src.training.loop import history_step

log = logging.getLogger(__name__)


def check_settings(cfg: DictConfig, ranks: Ranks | None) -> Strategy:
    """The checks of the settings themselves (no data, no model); returns the unstarted
    strategy. `ranks`: the ranks torchrun or srun started, this process among them, if any."""
    trainer = cfg.trainer
    typed(TrainerConfig, trainer)  # its ranges
    device_type = resolve_device_type(trainer.accelerator)
    if (
        trainer.precision == "bf16"
        and device_type == "cuda"
        # V100 and T4 only emulate bf16 (slowly), and pass unless emulation is left out.
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ConfigError("trainer.precision=bf16 but this GPU has no bf16 support; use fp32")
    if trainer.activation_checkpointing and cfg.parallel.get("deferred_batchnorm"):
        raise ConfigError(
            "parallel.deferred_batchnorm=true cannot run with trainer.activation_checkpointing="
            "true: the recomputed forward passes would update the running statistics again; set "
            "one of them to false"
        )
    strategy = build_strategy(cfg.parallel, device_type, trainer.precision, ranks)
    strategy.check_visible_gpus()
    strategy.check_batch(trainer.batch_size // trainer.accumulate)
    strategy.check_accumulate(trainer.accumulate)
    check_tracker(cfg.logger)
    check_checkpoint_format(trainer, strategy)
    return strategy


@dataclass
class Blueprint:
    """What the up-front build on the meta device settled, for the real build to reuse."""

    data: Data
    task: Any
    meta_model: nn.Module  # shapes only
    checkpoint: Path | None  # to resume from
    saved: dict[str, Any] | None  # its structure; a full checkpoint's tensors memory-mapped


def build_blueprint(cfg: DictConfig, run_dir: Path, strategy: Strategy) -> Blueprint:
    """Build data, task and model (on the meta device: no memory, no compute) and check them:
    whatever their builders reject fails here, as does a model output the task cannot take, a
    model the strategy cannot place (which also settles a pipeline's stage split) and a
    checkpoint that does not fit this run."""
    with blame("data"):
        data = build_data(cfg.data, cfg.seed)
    check_data(cfg, data)
    with blame("task"):
        task = instantiate(cfg.task)
    model = build_model(cfg, data, torch.device("meta"))
    check_model(cfg, strategy, model, task, data)
    checkpoint = resume_path(cfg.trainer.resume, run_dir, announce=True)
    saved = load_checkpoint(checkpoint, mmap=True) if checkpoint is not None else None
    if saved is not None:
        check_resumable(saved, checkpoint, model, cfg)
    return Blueprint(data, task, model, checkpoint, saved)


def check_config(cfg: DictConfig, run_dir: Path, ranks: Ranks | None = None) -> Strategy:
    """Every check that needs no process or device work (the launcher's, before it starts any
    rank); returns the unstarted strategy."""
    strategy = check_settings(cfg, ranks)
    build_blueprint(cfg, run_dir, strategy)
    return strategy


def build_model(cfg: DictConfig, data: Data, device: torch.device | None = None) -> nn.Module:
    """`cfg.model` for `data`'s shapes, on `device` (None: the CPU, initialised from the RNG)."""
    with blame("model"), torch.device(device or "cpu"):
        return instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)


def check_data(cfg: DictConfig, data: Data) -> None:
    if len(data.train) < cfg.trainer.batch_size:
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} is more than the {len(data.train)} "
            "training samples; lower trainer.batch_size or use more data"
        )
    if cfg.data.augment and len(data.input_shape) != 3:
        raise ConfigError(
            f"data.augment=true crops and flips images (channels, height, width), but this "
            f"set's inputs are shaped {data.input_shape}; set data.augment=false"
        )


def check_model(
    cfg: DictConfig, strategy: Strategy, model: nn.Module, task: Any, data: Data
) -> None:
    """`model` (on the meta device) gives outputs the task takes, has something to train, can be
    placed by `strategy`, and its optimizer and schedule can be built."""
    inputs, targets = meta_batch(data)
    check_model_output(model, task, inputs, targets, data.num_classes, cfg.model._target_)
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise ConfigError(
            f"model: {cfg.model._target_} has no trainable parameters (none requires a "
            "gradient), so there is nothing to train"
        )
    strategy.check_model(model, inputs)
    with blame("optimizer"):
        build_optimizer(cfg.optimizer, model.parameters())
        lr_schedule(cfg.optimizer, cfg.trainer.max_steps)


def meta_batch(data: Data) -> tuple[Tree, Tree]:
    """Inputs and targets shaped like two training samples, on the meta device."""
    return meta_samples(data.train, 2)


def check_model_output(
    model: nn.Module,
    task: Any,
    inputs: Tree,
    targets: Tree,
    num_classes: int,
    name: str,
) -> None:
    """Run `model` (on the meta device; this also sizes lazy modules) and the task's sums on its
    outputs (a tensor, tuple, list or dict): raise ConfigError for outputs the task cannot take.
    A model that cannot run on the meta device at all is left to show its errors in training."""
    try:
        with torch.no_grad():
            outputs = model(inputs)
    except Exception:  # noqa: BLE001 - e.g. no meta kernel, or a forward that reads the values
        log.debug("model: no forward pass on the meta device", exc_info=True)
        return
    shapes = (
        f"model: {name} returns outputs shaped {describe(outputs)} for inputs shaped "
        f"{describe(inputs)} and targets shaped {describe(targets)}"
    )
    check = getattr(task, "check", None)  # optional for a task of your own
    problem = check(outputs, targets, num_classes) if check else None
    if problem:
        raise ConfigError(f"{shapes}, but for {type(task).__name__} {problem}")
    try:
        task.sums(outputs, targets)
    except (RuntimeError, TypeError, KeyError, IndexError, AttributeError) as error:
        raise ConfigError(
            f"{shapes}, which {type(task).__name__} cannot score "
            f"({type(error).__name__}: {''.join(str(error).strip().splitlines()[:1])})"
        ) from error


def check_checkpoint_format(trainer: DictConfig, strategy: Strategy) -> None:
    checkpoint_format = resolved_format(trainer.checkpoint_format, strategy)
    if checkpoint_format == "sharded" and not strategy.sharded_checkpoints:
        raise ConfigError(
            "trainer.checkpoint_format=sharded is for parallel=single, ddp, fsdp and the mesh "
            f"layouts (tp, pp, fsdp_tp), not {strategy.name}; use full (or auto)"
        )
    if trainer.async_checkpoint and checkpoint_format != "sharded":
        raise ConfigError(
            "trainer.async_checkpoint=true writes sharded checkpoints only; set "
            "trainer.checkpoint_format=sharded"
        )


def set_numerics(trainer: DictConfig, device_type: str) -> str:
    """This process's math settings for the run; returns the float32 matmul precision in use.

    Set on every run, not left as found: the jobs of a multirun share one process."""
    if trainer.deterministic:
        # cuBLAS is only deterministic with a fixed workspace (torch reproducibility notes).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(trainer.deterministic)
    # TF32 on CUDA: an fp32 8192^3 matmul took 21.5 ms at "highest" and 2.7 ms at "high" on an
    # H200. CPUs keep true fp32 unless asked, so that CPU runs stay comparable bit for bit.
    precision = trainer.matmul_precision
    if precision == "auto":
        precision = "high" if device_type == "cuda" else "highest"
    torch.set_float32_matmul_precision(precision)
    # Input shapes repeat every step, so cuDNN's one-time search for the fastest convolution
    # algorithm pays off; it is non-deterministic, so not with trainer.deterministic.
    torch.backends.cudnn.benchmark = device_type == "cuda" and not trainer.deterministic
    return precision


@contextlib.contextmanager
def blame(group: str) -> Iterator[None]:
    """A ValueError or FileNotFoundError while building `group` means a setting its builder
    cannot use: report it as a ConfigError, naming the group when the builder's message does not."""
    try:
        yield
    except (ValueError, FileNotFoundError, InstantiationException) as error:
        cause = error.__cause__ if isinstance(error, InstantiationException) else error
        if not isinstance(cause, (ValueError, FileNotFoundError)):
            raise
        message = str(cause)
        raise ConfigError(message if group in message else f"{group}: {message}") from cause


def check_resumable(state: dict[str, Any], path: Path, model: nn.Module, cfg: DictConfig) -> None:
    """The checkpoint fits this run: same parameter shapes, same optimizer, steps left to do."""
    saved = state["config"]
    expected = {key: list(value.shape) for key, value in model.state_dict().items()}
    found = {key: list(value.shape) for key, value in state["model"].items()}
    if found != expected:
        key = next(
            k for k in sorted(expected.keys() | found.keys()) if expected.get(k) != found.get(k)
        )
        trained = " ".join(f"model.{k}={v}" for k, v in saved["model"].items() if k != "_target_")
        raise ConfigError(
            f"trainer.resume: {path} holds a different model ({key}: {found.get(key)} there, "
            f"{expected.get(key)} here); it was trained with {saved['model']['_target_']} "
            f"{trained} on {saved['data']['_target_']}: resume with those settings, or start a "
            "new run"
        )
    if saved["optimizer"]["name"] != cfg.optimizer.name:
        raise ConfigError(
            f"trainer.resume: {path} was trained with optimizer={saved['optimizer']['name']}; "
            "resume with the same optimizer, or start a new run"
        )
    if state["step"] >= cfg.trainer.max_steps and not finished(state, cfg):
        raise ConfigError(
            f"trainer.resume: {path} is at step {state['step']} and trainer.max_steps="
            f"{cfg.trainer.max_steps}, so there is nothing left to train; raise trainer.max_steps"
        )
    check_schedule_kept(state, path, cfg)


def check_schedule_kept(state: dict[str, Any], path: Path, cfg: DictConfig) -> None:
    """A cosine schedule decays over trainer.max_steps unless optimizer.schedule_steps says
    otherwise; resuming with another max_steps would quietly stretch or shrink it, and the
    learning rate would jump. That takes optimizer.schedule_steps, set either way."""
    saved = state["config"]
    saved_length = schedule_length(saved["optimizer"], saved["trainer"]["max_steps"])
    length = schedule_length(cfg.optimizer, cfg.trainer.max_steps)
    if cfg.optimizer.schedule_steps is not None or length == saved_length:
        return
    kept, stretched = lr_schedule(cfg.optimizer, saved_length), lr_schedule(cfg.optimizer, length)
    changed = (
        step
        for step in range(state["step"], cfg.trainer.max_steps)
        if not math.isclose(kept(step), stretched(step), rel_tol=1e-9)
    )
    step = next(changed, None)
    if step is not None:
        raise ConfigError(
            f"trainer.resume: {path} was trained with a cosine schedule over {saved_length} "
            f"steps; trainer.max_steps={cfg.trainer.max_steps} would rescale it to {length} "
            f"steps, changing the learning rate from step {step + 1} on ({stretched(step):.3g} "
            f"instead of {kept(step):.3g}). Set optimizer.schedule_steps={saved_length} to keep "
            f"the schedule (later steps keep its final rate), or optimizer.schedule_steps="
            f"{length} to stretch it"
        )


def saved_lr(state: dict[str, Any]) -> Callable[[int], float]:
    """The learning-rate schedule a checkpoint was trained with."""
    saved = state["config"]
    return lr_schedule(OmegaConf.create(saved["optimizer"]), saved["trainer"]["max_steps"])


def finished(state: dict[str, Any], cfg: DictConfig) -> bool:
    """With trainer.resume=auto, the checkpoint of a run that trained all its steps (killed, say,
    after writing it): a requeued job then ends at once, successfully."""
    return cfg.trainer.resume == "auto" and state["step"] == cfg.trainer.max_steps


def finish_finished_run(
    cfg: DictConfig, run_dir: Path, strategy: Strategy, checkpoint: Path, ranks: Ranks | None
) -> dict[str, Any]:
    """The summary of a run that had trained all its steps; written if the run died before."""
    path = summary_file(run_dir)
    log.info(
        "%s is at step %d of trainer.max_steps=%d: this run is complete, nothing to do",
        checkpoint,
        cfg.trainer.max_steps,
        cfg.trainer.max_steps,
    )
    if path.exists() or (ranks is not None and ranks.rank != 0):
        return json.loads(path.read_text()) if path.exists() else {}
    history = metrics_file(run_dir)
    lines = history.read_text().splitlines() if history.exists() else []
    rows = [json.loads(line) for line in lines if history_step(line) < math.inf]  # whole lines

    def last(key: str) -> float:
        return next((row[key] for row in reversed(rows) if key in row), math.nan)

    summary = {
        "strategy": strategy.name,
        "devices": cfg.parallel.devices,
        "world_size": strategy.world_size,
        "global_batch": cfg.trainer.batch_size,
        "steps": cfg.trainer.max_steps,
        "final_train_loss": last("train/loss"),
        "final_train_accuracy": last("train/accuracy"),
        "final_val_loss": last("val/loss"),
        "val_accuracy": last("val/accuracy"),
        "completed_before_resume": True,  # the timings were lost with the process that trained
    }
    write_summary(summary, run_dir)
    return summary


def write_summary(summary: dict[str, Any], run_dir: Path) -> None:
    """summary.json in the run folder, and the summary in the log."""
    summary_file(run_dir).write_text(json.dumps(summary, indent=2) + "\n")
    log.info(format_summary(summary, run_dir))


def size_lazy_modules(model: nn.Module, data: Data) -> None:
    """Give lazy modules (`nn.LazyLinear`, ...) their sizes with a forward pass on two training
    samples, before any strategy copies, splits or shards the model: they cannot size
    themselves later (DDP and FSDP refuse them). Every process does this alike, so the draws of
    their initialisation are the same for every strategy."""
    if not any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
        return
    model.eval()
    with torch.no_grad():
        model(first_samples(data.train, 2)[0])
    model.train()


def log_resumed_schedule(cfg: DictConfig, state: dict[str, Any], checkpoint: Path) -> None:
    """Where the run resumes, and its learning rate; a schedule that changed is a warning."""
    step = state["step"]
    lr = lr_schedule(cfg.optimizer, cfg.trainer.max_steps)(step)
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


def format_summary(summary: dict[str, Any], run_dir: Path) -> str:
    """`key=value` for every figure of summary.json, a few to a line."""

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return "nan"
            return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
        if isinstance(value, list):
            return ",".join(fmt(v) for v in value)
        return str(value).replace(" ", "_")

    pairs = [f"{key}={fmt(value)}" for key, value in summary.items()]
    pairs.append(f"outputs={run_dir}")
    text = "run summary: " + " ".join(pairs)
    wrap = textwrap.TextWrapper(
        width=100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
    )
    return "\n".join(wrap.wrap(text))
