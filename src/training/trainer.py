"""One process's run, owned by one object: `Trainer`.

`with Trainer(cfg, run_dir, strategy, blueprint) as trainer: trainer.train()`. Entering builds
every part once, from the up-front build on the meta device (`build.build_blueprint`, whose
data and task it reuses): the model for real (seeded, wrapped by the strategy), its optimizer,
the train state restored from the checkpoint to resume from, the tracker, the batches, and the
parts that decide when they are due (progress, evaluation, checkpointing). `train` is the loop,
read top to bottom; leaving ends the tracker and the strategy's processes.

A checkpoint holds model, optimizer, the weight average (trainer.ema_decay: `ema.py`) and one
train state, `Trainer.state_dict()`: the step (the data position too: batches are a function of
seed and step; a streamed set's position, gathered from the ranks that read it, is kept beside
it), the RNG, fp16's loss scale, the tracker's run id, the config, and what rebuilds the model
from it (the data's input shape and classes, the model's tied weights and parameter names).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from src.checkpoint.store import best_dir, rng_state, set_rng_state
from src.checkpoint.writer import CheckpointWriter, gathered, resolved_format
from src.components.blocks import CompiledSums
from src.components.data_contract import tokens_per_sample
from src.components.optimizer import block_matrices, build_optimizer
from src.components.schedules import lr_schedule
from src.config.base import plain_config
from src.config.job import JobConfig, job_config
from src.config.trainer import TrainerConfig
from src.observe.performance import profiling, step_flops
from src.observe.tensor_memory import TensorPeak
from src.observe.tracking import Trackers, build_tracker
from src.parallel.base import Strategy
from src.parallel.devices import process_peak_memory_mb
from src.runtime.run_folder import metrics_file, tokenizer_dir
from src.runtime.stopping import Interrupted, StopOnSignal, agree_to_stop
from src.training.build import (
    Blueprint,
    build_blueprint,
    build_wrapped_model,
    checkpoint_to_load,
    model_description,
    set_numerics,
)
from src.training.ema import EMA
from src.training.inputs import input_batches, keep_on_device
from src.training.loop import (
    Checkpointing,
    Evaluation,
    History,
    Progress,
    Throughput,
    open_history,
    summary_val_figures,
)
from src.training.monitoring import Monitoring
from src.training.resume import log_resumed_schedule
from src.training.step import Stepper, forward_backward
from src.training.summary import reset_peak_memory, run_summary, write_summary

log = logging.getLogger(__name__)


def train(
    cfg: JobConfig | DictConfig,
    run_dir: Path,
    strategy: Strategy,
    blueprint: Blueprint | None = None,
    stop: StopOnSignal | None = None,
) -> dict[str, Any]:
    """Train in this process (one of several, for multi-process strategies); the summary."""
    with Trainer(cfg, run_dir, strategy, blueprint, stop) as trainer:
        return trainer.train()


class Trainer:
    """The run of one process: its parts, built once on entering, and its train state.

    `cfg`: the job's config, typed (a composed one is typed here: the tests' way in).
    `blueprint`: the up-front build on the meta device, if done already (else done here).
    `stop`: the stop handler this process holds, if any (None: `train` installs one)."""

    def __init__(
        self,
        cfg: JobConfig | DictConfig,
        run_dir: Path,
        strategy: Strategy,
        blueprint: Blueprint | None = None,
        stop: StopOnSignal | None = None,
    ):
        self.job = job_config(cfg)
        self.cfg, self.run_dir, self.strategy, self.stop = self.job.cfg, run_dir, strategy, stop
        self.blueprint = blueprint or build_blueprint(self.job, run_dir, strategy)
        self.settings: TrainerConfig = self.job.trainer
        self.resolved = plain_config(self.cfg)
        self.task = self.blueprint.task
        self.model_description = model_description(self.blueprint)
        self.step = 0  # the last step trained
        self.tracker_ids: dict[str, str | None] = {}  # each logger's run to continue
        self.data_position: dict[int, list[int]] | None = None  # a stream's, to go on from
        self.tracker: Trackers | None = None
        self.finished = False
        self.stopped_early = False
        self.tested_step: int | None = None  # whose weights the test pass scored

    def __enter__(self) -> Trainer:
        self.strategy.setup()
        try:
            reset_peak_memory(self.strategy)
            self.build()
        except BaseException:
            self.strategy.teardown()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self.tracker is not None and not self.finished:
                self.tracker.finish(None, 1)
        finally:
            self.strategy.teardown()

    def build(self) -> None:
        """Every part of the run, restored from the checkpoint to resume from."""
        cfg, settings = self.cfg, self.settings
        strategy, blueprint = self.strategy, self.blueprint
        self.matmul_precision = set_numerics(settings, strategy.device_type)
        self.flops_per_step = step_flops(
            blueprint.meta_model, self.task, blueprint.data, settings.batch_size
        )
        data = blueprint.data
        if not cfg.data.augment:  # augmented samples are made on the host, by the loader
            data = keep_on_device(data, strategy.devices[0])
        self.model, self.optimizer, self.ema, state = self.build_model_and_optimizer()
        if settings.compile:
            self.task = CompiledSums(self.task)
        self.stepper = Stepper(self.settings, strategy, self.model, self.optimizer)
        # On CPU, beside the process's resident peak; not around compiled blocks, whose
        # graphs dynamo would build for the tracker's dispatch mode.
        counted = (
            settings.count_tensor_memory and strategy.device_type == "cpu" and not settings.compile
        )
        self.tensor_peak = TensorPeak(self.model, self.optimizer, counted)
        if state is not None:
            self.load_state_dict(state)
        self.tracker = build_tracker(
            cfg.logger, self.run_dir, self.resolved, strategy.is_main, self.tracker_ids, self.step
        )
        if strategy.is_main and data.tokenizer is not None:
            data.tokenizer.save(tokenizer_dir(self.run_dir))
        self.batches, self.val, self.test = input_batches(
            self.job, strategy, data, self.step, self.data_position
        )
        self.lr_at = lr_schedule(cfg.optimizer, settings.max_steps)
        self.speed = Throughput(
            max(settings.timing_warmup_steps, self.tensor_peak.counted_steps),  # never timed
            settings.batch_size,
            tokens_per_sample(blueprint.data.train),
        )
        self.progress = Progress(settings, strategy, self.task, self.speed)
        counting, evaluated = self.tensor_peak.evaluation, self.ema.evaluated
        self.evaluation = Evaluation(
            settings, strategy, self.task, self.val, self.speed, "val", counting, evaluated
        )
        self.testing = Evaluation(
            settings, strategy, self.task, self.test, self.speed, "test", weights=evaluated
        )
        writer = CheckpointWriter(
            self.run_dir,
            strategy,
            resolved_format(settings.checkpoint_format, strategy),
            settings.keep_checkpoints,
            settings.async_checkpoint,
            settings.checkpoint_errors,
            self.ema.saved(),
        )
        self.checkpointing = Checkpointing(
            writer, settings.checkpoint_every, self.speed, self.step, settings.checkpoint
        )
        self.monitoring = Monitoring(settings, strategy, writer, self.speed, evaluated)
        if state is not None and state.get("monitor"):  # the train state's, which older
            self.monitoring.load_state_dict(state["monitor"])  # checkpoints lack

    def build_model_and_optimizer(
        self,
    ) -> tuple[nn.Module, torch.optim.Optimizer, EMA, dict[str, Any] | None]:
        """The model (seeded, so every strategy starts from single's weights, or from
        trainer.init_from's), wrapped by the strategy, its optimizer and its weight average, all
        restored from the checkpoint to resume from; with that checkpoint's train state (None
        when starting afresh)."""
        cfg, strategy, blueprint = self.cfg, self.strategy, self.blueprint
        state, in_shards = checkpoint_to_load(blueprint, strategy)
        model = build_wrapped_model(
            self.job, strategy, blueprint.data, None if in_shards else state, blueprint.init_from
        )
        optimizer = build_optimizer(
            cfg.optimizer,
            strategy.trained_parameters(model),
            block_matrices(strategy.unwrap(model)),
        )
        ema = EMA(self.settings, strategy.trained_parameters(model))
        if state is None:
            if self.settings.resume and strategy.is_main:
                run_dir = self.run_dir
                log.info("trainer.resume=auto: no checkpoint in %s yet, starting afresh", run_dir)
            return model, optimizer, ema, None
        if in_shards:
            strategy.load_sharded(model, optimizer, str(blueprint.checkpoint))
        else:
            strategy.load_optimizer_state_dict(model, optimizer, state["optimizer"])
        ema.load(strategy, model, state, blueprint.checkpoint, in_shards)
        return model, optimizer, ema, state

    def state_dict(self) -> dict[str, Any]:
        """The train state a checkpoint holds besides model and optimizer."""
        return {
            "step": self.step,
            "rng": rng_state(),
            "loss_scaling": self.stepper.scaling.state_dict(),
            "config": self.resolved,
            "tracker_run_ids": self.tracker.run_ids,
            "monitor": self.monitoring.state_dict(),
            "stopped_early": self.stopped_early,
            "data_position": self.gathered_data_position(),
            **self.model_description,
        }

    def gathered_data_position(self) -> dict[int, list[int]] | None:
        """A stream's position: each rank knows its own streams' (every rank asks: a
        checkpoint is written by all of them together); None for batches that the step gives."""
        position = self.batches.position()
        if position is None:
            return None
        return {stream: at for part in gathered(position) for stream, at in part.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint's train state (`state_dict`'s keys)."""
        self.step = state["step"]
        set_rng_state(state["rng"])
        if self.strategy.is_main:
            log_resumed_schedule(self.job, state, self.blueprint.checkpoint)
        if state.get("loss_scaling"):  # older checkpoints have none
            self.stepper.scaling.load_state_dict(state["loss_scaling"])
        # Checkpoints written before the other loggers hold the W&B run's id alone.
        self.tracker_ids = state.get("tracker_run_ids", {"wandb": state.get("wandb_run_id")})
        self.data_position = state.get("data_position")  # older checkpoints have none

    def train(self) -> dict[str, Any]:
        """Train from the step after the train state's to `trainer.max_steps`; returns the
        summary (also in summary.json). Ends early with `Interrupted` after SIGINT/SIGTERM,
        checkpointed: one process after the current step, several together after their next log,
        eval or checkpoint step; with `NonFiniteLoss` before a NaN/inf loss reaches a log or
        checkpoint."""
        strategy, stepper, settings = self.strategy, self.stepper, self.settings
        model, start_step = self.model, self.step
        with (
            open_history(
                self.tracker, metrics_file(self.run_dir), start_step, strategy.is_main
            ) as history,
            contextlib.nullcontext(self.stop) if self.stop else StopOnSignal() as stop,
            profiling(settings, strategy, self.run_dir, self.tracker) as profiler,
            contextlib.closing(self.checkpointing.writer),  # publishes a save in flight
        ):
            model.train()
            for step in range(start_step + 1, settings.max_steps + 1):
                self.step = step
                lr = self.lr_at(step - 1)
                with self.tensor_peak.step():
                    step_sums, targets = forward_backward(
                        model,
                        strategy,
                        self.task,
                        self.batches,
                        stepper.precision,
                        settings.accumulate,
                        stepper.scaling,
                    )
                    updated = stepper.update(step, lr, step_sums)
                    if updated:
                        self.ema.update()
                if updated:
                    self.progress.add(step_sums, targets)
                self.speed.step_done(strategy, self.batches.take_wait())
                profiler.step()

                last = step == settings.max_steps
                stop_signal = self.agreed_stop(stop, step)
                stopping = stop_signal is not None
                logged = {
                    **self.progress.maybe_log(step, lr, history, force=last),
                    **self.evaluation.maybe_run(
                        step, model, stepper.precision, history, force=last
                    ),
                }
                self.stopped_early = self.monitoring.observe(
                    step, logged, model, self.optimizer, self.state_dict
                )
                if self.stopped_early:  # the run's last step: its training figures too
                    self.progress.maybe_log(step, lr, history, force=True)
                saved_to = self.checkpointing.maybe_save(
                    step,
                    model,
                    self.optimizer,
                    self.state_dict,
                    force=last or stopping or self.stopped_early,
                )
                if stopping:
                    raise Interrupted.by(stop_signal, step, saved_to)
                if self.stopped_early:
                    if strategy.is_main:
                        log.info(self.monitoring.stop_reason())
                    break
            if settings.test:
                self.run_test(history)
        summary = run_summary(
            self.job, strategy, self.final_figures(), self.flops_per_step, self.matmul_precision
        )
        self.tracker.log_model(best_dir(self.run_dir), self.monitoring.summary())
        self.finished = True
        self.tracker.finish(summary, 0)
        if strategy.is_main:
            if untimed := self.speed.untimed():
                log.info(untimed)
            write_summary(summary, self.run_dir)
        return summary

    def run_test(self, history: History) -> None:
        """Score the model on the test split at the last step: after an early stop, the best
        checkpoint's weights (kept in memory since it was written), else the final ones."""
        self.tested_step = self.step
        if self.stopped_early and self.monitoring.best_weights is not None:
            self.monitoring.restore_best(self.model)
            self.tested_step = self.monitoring.best_step
        elif self.stopped_early and self.strategy.is_main:
            log.warning(  # a run resumed after its best: the weights went with that process
                "the best weights (step %d) are not in memory: testing the final model",
                self.monitoring.best_step,
            )
        if self.strategy.is_main:
            log.info("testing the weights of step %d on the test split", self.tested_step)
        self.testing.run(self.step, self.model, self.stepper.precision, history)

    def agreed_stop(self, stop: StopOnSignal, step: int) -> int | None:
        """The signal all processes agreed to stop for after `step` (see `agree_to_stop`), or
        None to go on; None at the last step too, which ends the run anyway."""
        last = step == self.settings.max_steps
        # Several processes stop together, after a step they synchronize at anyway; one
        # process on its own stops after the current step.
        in_sync = (
            last
            or self.progress.due(step)
            or self.evaluation.due(step)
            or self.checkpointing.due(step)
        )
        stop_signal = agree_to_stop(
            self.strategy,
            self.stepper.nonfinite,
            stop,
            step,
            in_sync,
            self.checkpointing.last_step,
        )
        return None if last else stop_signal

    def final_figures(self) -> dict[str, Any]:
        memory_devices, (memory_mb, tensor_mb) = self.strategy.peak_memory_mb(
            process_peak_memory_mb, self.tensor_peak.peak_mb
        )
        tested = self.tested_step is not None
        test_figures = {f"test_{name}": value for name, value in self.testing.figures.items()}
        return {
            "steps": self.step,
            "stopped_early": self.stopped_early,
            **{f"final_train_{name}": value for name, value in self.progress.figures.items()},
            **summary_val_figures(self.evaluation.figures),
            **({**test_figures, "test_step": self.tested_step} if tested else {}),
            **self.monitoring.summary(),
            "skipped_steps": self.stepper.skipped_steps,
            "scaler_skipped_steps": self.stepper.scaling.skipped_steps,
            **self.speed.summary(),
            "peak_memory_mb": memory_mb,
            "tensor_peak_mb": tensor_mb,
            "memory_devices": memory_devices,
            "wall_time_s": time.perf_counter() - self.speed.started,
            # What a checkpoint costs the training (trainer.async_checkpoint: staging only).
            "checkpoint_blocked_s": statistics.median(self.checkpointing.blocked_s or [0.0]),
        }
