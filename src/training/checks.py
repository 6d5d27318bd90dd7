"""The checks that need no process or device: the settings (`check_settings`: ranges, what the
strategy can split, the tracker, the checkpoint format), the data, and the model built on the meta
device with the task's view of its outputs. Each failure is a ConfigError, one line naming the
setting to change."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from hydra.errors import InstantiationException
from torch import nn

from src.checkpoint.writer import resolved_format
from src.components import models
from src.components.batches import Tree, describe
from src.components.blocks import saved_ops
from src.components.data_contract import Data, Stream, meta_samples
from src.components.model_contract import settle_model_settings
from src.components.optimizer import block_matrices, build_optimizer, settle_optimizer_settings
from src.components.schedules import lr_schedule
from src.config.base import ConfigError, first_line
from src.config.job import JobConfig
from src.config.parallel import Offload
from src.config.trainer import Recomputation, TrainerConfig
from src.observe.tracking import check_tracker
from src.parallel import build_strategy
from src.parallel.base import Strategy
from src.parallel.devices import resolve_device_type
from src.runtime.ranks import Ranks

log = logging.getLogger(__name__)


def check_settings(job: JobConfig, ranks: Ranks | None) -> Strategy:
    """The checks of the settings themselves (no data, no model), beyond each one's range
    (`job_config`'s); returns the unstarted strategy. `ranks`: the ranks torchrun or srun
    started, this process among them, if any."""
    cfg, trainer = job.cfg, job.trainer
    settle_model_settings(cfg)
    settle_optimizer_settings(cfg)
    device_type = resolve_device_type(trainer.accelerator)
    if (
        trainer.precision == "bf16"
        and device_type == "cuda"
        # V100 and T4 only emulate bf16 (slowly), and pass unless emulation is left out.
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ConfigError("trainer.precision=bf16 but this GPU has no bf16 support; use fp32")
    recomputation = trainer.activation_checkpointing
    if recomputation != Recomputation.none and cfg.parallel.get("deferred_batchnorm"):
        raise ConfigError(
            "parallel.deferred_batchnorm=true cannot run with trainer.activation_checkpointing="
            f"{recomputation}: the recomputed forward passes would update the running statistics "
            "again; set deferred_batchnorm=false or activation_checkpointing=none"
        )
    if recomputation == Recomputation.selective:
        saved_ops(trainer.checkpoint_ops)
    strategy = build_strategy(cfg.parallel, device_type, trainer.precision, ranks)
    if cfg.parallel.get("offload") == Offload.cpu and device_type != "cuda":
        # Refused, not ignored: on the CPU the shards are in host memory already, and a run that
        # said it offloaded would report the same memory as one that did not.
        raise ConfigError(
            "parallel.offload=cpu moves FSDP's shards from GPU memory to the host, and this run "
            "is on the CPU; set parallel.offload=none (or train on a GPU)"
        )
    strategy.check_visible_gpus()
    strategy.check_batch(trainer.batch_size // trainer.accumulate)
    strategy.check_accumulate(trainer.accumulate)
    check_tracker(cfg.logger)
    check_checkpoint_format(trainer, strategy)
    return strategy


def check_data(job: JobConfig, data: Data, data_shards: int) -> None:
    trainer = job.trainer
    if isinstance(data.train, Stream):
        with blame("data"):
            data.train.check_shards(data_shards)
    elif len(data.train) < trainer.batch_size:
        raise ConfigError(
            f"trainer.batch_size={trainer.batch_size} is more than the {len(data.train)} "
            "training samples; lower trainer.batch_size or use more data"
        )
    if trainer.test and data.test is None:
        raise ConfigError(
            "trainer.test=true scores the test split, but data.test_fraction=0 leaves none; set "
            "trainer.test=false, or data.test_fraction above 0"
        )
    if job.cfg.data.augment and len(data.input_shape) != 3:
        raise ConfigError(
            f"data.augment=true crops and flips images (channels, height, width), but this "
            f"set's inputs are shaped {data.input_shape}; set data.augment=false"
        )


def check_model(
    job: JobConfig, strategy: Strategy, model: nn.Module, task: Any, data: Data
) -> None:
    """`model` (on the meta device) gives outputs the task takes, has something to train, can be
    placed by `strategy`, and its optimizer and schedule can be built."""
    cfg = job.cfg
    inputs, targets = meta_batch(data)
    figures = check_model_output(model, task, inputs, targets, data.num_classes, cfg.model._target_)
    check_monitor(job.trainer.monitor, figures, cfg.task._target_)
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise ConfigError(
            f"model: {cfg.model._target_} has no trainable parameters (none requires a "
            "gradient), so there is nothing to train"
        )
    strategy.check_model(model, inputs)
    with blame("optimizer"):
        build_optimizer(cfg.optimizer, model.parameters(), block_matrices(model))
        lr_schedule(cfg.optimizer, job.trainer.max_steps)


def meta_batch(data: Data) -> tuple[Tree, Tree]:
    """Inputs and targets shaped like two training samples, on the meta device."""
    return meta_samples(data.train, 2)


def check_token_inputs(model: nn.Module, inputs: Tree, name: str) -> None:
    """A model that looks its inputs up in an embedding, given real-valued features: the data
    option does not give token ids (the forward pass on the meta device failed for it)."""
    embeds = any(isinstance(module, nn.Embedding) for module in model.modules())
    if embeds and isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        raise ConfigError(
            f"model: {name} looks token ids up in an embedding, but the data gives real-valued "
            f"inputs shaped {describe(inputs)}; use token data (data=synthetic_tokens or "
            "data=tokens) with task=language_model"
        )


def check_model_output(
    model: nn.Module,
    task: Any,
    inputs: Tree,
    targets: Tree,
    num_classes: int,
    name: str,
) -> list[str] | None:
    """Run `model` (on the meta device; this also sizes lazy modules) and the task's sums on its
    outputs (a tensor, tuple, list or dict): raise ConfigError for outputs the task cannot take.
    Returns the names of the task's figures (None for a model that cannot run on the meta device
    at all, which is left to show its errors in training)."""
    try:
        with torch.no_grad():
            outputs = model(inputs)
    except Exception as error:  # noqa: BLE001 - e.g. no meta kernel, or a forward that reads the values
        check_token_inputs(model, inputs, name)
        if type(model).__module__ == models.__name__:  # every one of them runs on meta tensors
            raise ConfigError(
                f"model: {name} cannot take inputs shaped {describe(inputs)} "
                f"({type(error).__name__}: {first_line(error)}); choose a data option whose "
                "inputs it takes, or a model of your own (model._target_)"
            ) from error
        log.debug("model: no forward pass on the meta device", exc_info=True)
        return None
    shapes = (
        f"model: {name} returns outputs shaped {describe(outputs)} for inputs shaped "
        f"{describe(inputs)} and targets shaped {describe(targets)}"
    )
    check = getattr(task, "check", None)  # optional for a task of your own
    problem = check(outputs, targets, num_classes) if check else None
    if problem:
        raise ConfigError(f"{shapes}, but for {type(task).__name__} {problem}")
    try:
        sums = task.sums(outputs, targets)
    except (RuntimeError, TypeError, KeyError, IndexError, AttributeError) as error:
        raise ConfigError(
            f"{shapes}, which {type(task).__name__} cannot score "
            f"({type(error).__name__}: {first_line(error)})"
        ) from error
    return list(task.figures([1.0] * len(sums), 1.0))  # the names; any values will do


def check_monitor(monitor: str | None, figures: list[str] | None, task: str) -> None:
    """trainer.monitor names a figure of the task that training or evaluation logs (val/* is
    logged at least once, by the evaluation after the last step)."""
    if monitor is None or figures is None:
        return
    logged = [f"{split}/{name}" for split in ("val", "train") for name in figures]
    if monitor not in logged:
        raise ConfigError(
            f"trainer.monitor={monitor} is never logged: task {task} logs {', '.join(logged)}; "
            "choose one of them, or trainer.monitor=null for no best checkpoint"
        )


def check_checkpoint_format(trainer: TrainerConfig, strategy: Strategy) -> None:
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
