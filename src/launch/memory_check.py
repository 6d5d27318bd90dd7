"""Measured peak tensor memory of real training steps and of evaluation, to hold the planner's
predictions to.

Each process of the configured strategy builds its model, wraps it, and runs as many real
training steps as the planner traces (two: the loop's own `forward_backward`, the real
optimizer) under torch's `MemTracker`, which counts every tensor storage alive per device; the
peak is the second step's, when the optimizer state exists. Then the loop's `evaluate` runs one
evaluation batch (`trainer.eval_batch`, the largest an evaluation runs), the optimizer state
still held, under the same tracker entered again, whose peak starts again from what is alive. On
CPU a device is a process (its replicas or stages share its memory), as in `peak_memory_mb`.
Used by `scripts/benchmark.py --only plan` and the tests.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from src.components.blocks import prepare_blocks
from src.components.data import build_data
from src.components.data_contract import Split, first_samples
from src.components.model_contract import build_model
from src.components.optimizer import block_matrices, build_optimizer
from src.components.precision import LossScaling, autocast
from src.components.tasks import build_task
from src.config.job import job_config
from src.launch.launcher import launch
from src.observe.tensor_memory import StorageTracker, peak_mb
from src.parallel import build_strategy
from src.planning.memory_trace import TRACED_STEPS, meta_model_and_inputs
from src.runtime.ranks import Ranks
from src.runtime.stopping import StopOnSignal
from src.training.ema import EMA
from src.training.step import evaluate, forward_backward


def measured_peaks_mb(cfg: DictConfig) -> dict[str, dict[str, float]]:
    """The largest per-process peaks of tensor memory of `cfg`'s strategy over two training
    steps (`training`) and over one evaluation batch after them (`evaluation`), in MB, each by
    MemTracker's categories and `Total` (processes started here for multi-process strategies;
    their rank 0's)."""
    strategy = build_strategy(cfg.parallel, "cpu", cfg.trainer.precision)
    if strategy.processes_per_node == 1:
        return step_peaks_mb(OmegaConf.to_container(cfg, resolve=True))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    logging_config = {"version": 1, "disable_existing_loggers": False}
    return launch(
        step_peaks_mb, (resolved,), strategy.processes_per_node, 1, cfg.parallel, logging_config
    )


def step_peaks_mb(
    resolved_cfg: dict[str, Any], ranks: Ranks | None = None, stop: StopOnSignal | None = None
) -> dict[str, dict[str, float]]:
    """This process's peak tensor memory (MB) over `TRACED_STEPS` training steps, and over one
    evaluation batch after them; as one of `ranks` when `launch` started it (two steps end
    before any stop request matters)."""
    job = job_config(OmegaConf.create(resolved_cfg))  # typed once, here: a rank's start
    cfg, trainer = job.cfg, job.trainer
    strategy = build_strategy(cfg.parallel, "cpu", trainer.precision, ranks)
    data = build_data(cfg.data, cfg.seed)
    strategy.check_model(*meta_model_and_inputs(cfg, data, 2))
    strategy.setup()
    micro_batch = trainer.batch_size // trainer.accumulate // strategy.data_shards
    task = build_task(cfg.task)
    torch.manual_seed(cfg.seed)
    # Sliced here, copied while tracked: a slice of an in-memory set made under the tracker
    # would count the whole set's storage.
    batch = first_samples(data.train, micro_batch)
    val = Split(*first_samples(data.val, min(trainer.eval_batch, len(data.val))))
    precision = autocast("cpu", trainer.precision)
    tracker = StorageTracker()
    try:
        with tracker:
            model = build_model(cfg.model, data.input_shape, data.num_classes)
            prepare_blocks(model, trainer.activation_checkpointing, False, trainer.checkpoint_ops)
            model = strategy.wrap(model)
            optimizer = build_optimizer(
                cfg.optimizer,
                strategy.trained_parameters(model),
                block_matrices(strategy.unwrap(model)),
            )
            average = EMA(trainer, strategy.trained_parameters(model))
            scaling = LossScaling(strategy.grad_scaler(trainer.precision == "fp16", 2.0**16))
            for _ in range(TRACED_STEPS):
                # Passed unnamed: as in the loop, a step's batches are gone once it is done (an
                # iterator kept in a name held the last one through the evaluation).
                forward_backward(
                    model,
                    strategy,
                    task,
                    iter([tuple(t.clone() for t in batch)] * trainer.accumulate),
                    precision,
                    trainer.accumulate,
                    scaling,
                )
                scaling.step(optimizer)
                average.update()
                optimizer.zero_grad(set_to_none=True)
        training = peak_mb(tracker)
        with tracker:  # its peak starts again from what is alive: model, optimizer state, average
            evaluate(model, strategy, task, val, trainer.eval_batch, precision)
        evaluation = peak_mb(tracker)
    finally:
        strategy.teardown()
    return {"training": training, "evaluation": evaluation}
