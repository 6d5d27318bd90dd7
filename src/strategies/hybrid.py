"""`parallel=hybrid`: DDP across processes, each process running the model as a pipeline.

`parallel.devices / parallel.stages` processes per node; process p drives GPUs
p * stages .. p * stages + stages - 1 (on CPU: `stages` CPU stages), where its copy of the model
is cut into stages as in `model_parallel` (same split points, same micro-batching). DDP wraps
each process's `Pipeline` as one multi-device module (`device_ids=None`) and averages its
gradients across the processes, as `ddp` does for whole replicas. Launching, logging, rank-0
writing and failures are `ddp`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from src.config import ConfigError
from src.strategies.base import DeviceShare, LossFn, ModelSizes, ring_bytes
from src.strategies.ddp import DDP
from src.strategies.pipeline import (
    Pipeline,
    boundary_bytes,
    bubble_fraction,
    check_microbatches,
    check_split_points,
    check_tied_parameters,
    log_layout,
    plan_split_points,
    stage_shares,
)


class Hybrid(DDP):
    def __init__(self, cfg, device_type: str):
        super().__init__(cfg, device_type)
        if cfg.stages < 1:
            raise ConfigError(f"parallel.stages must be at least 1, got {cfg.stages}")
        if cfg.devices % cfg.stages:
            raise ConfigError(
                f"parallel.devices={cfg.devices} does not divide into processes of "
                f"parallel.stages={cfg.stages} devices each; make parallel.devices a multiple of "
                "parallel.stages"
            )
        self.processes_per_node = cfg.devices // cfg.stages
        self.world_size = self.processes_per_node * cfg.nodes
        if self.world_size == 1:
            raise ConfigError(
                f"parallel=hybrid with parallel.devices={cfg.devices} and parallel.stages="
                f"{cfg.stages} is a single process, with nothing to run data-parallel: use "
                f"parallel=model_parallel parallel.devices={cfg.stages}, or raise parallel.devices "
                "to a multiple of parallel.stages"
            )
        check_microbatches(cfg.microbatches)
        check_split_points(cfg.split_points, cfg.stages, "parallel.stages")
        self.split_points = cfg.split_points  # until check_model has looked at the model
        self.layout: dict[str, Any] = {}

    def processes_from_settings(self) -> str:
        cfg = self.cfg
        return (
            f"parallel.devices={cfg.devices} / parallel.stages={cfg.stages} x "
            f"parallel.nodes={cfg.nodes}"
        )

    def check_batch(self, micro_batch: int) -> None:
        super().check_batch(micro_batch)
        check_microbatches(
            self.cfg.microbatches,
            micro_batch // self.world_size,
            "the batch per process and micro-step (batch_size / accumulate / processes)",
        )

    def check_model(self, model: nn.Module, inputs: torch.Tensor) -> None:
        self.split_points = plan_split_points(
            model, inputs, self.cfg.stages, self.cfg.split_points, "parallel.stages"
        )
        check_tied_parameters(model, self.split_points, self.device_type)

    def local_devices(self) -> list[torch.device]:
        if self.device_type == "cuda":
            # Modulo the visible GPUs: under `srun --gpus-per-task=<stages>` a rank sees its own.
            first = self.local_rank * self.cfg.stages % torch.cuda.device_count()
            return [torch.device("cuda", first + i) for i in range(self.cfg.stages)]
        return [torch.device("cpu")] * self.cfg.stages

    def wrap(self, model: nn.Module) -> nn.Module:
        pipeline = Pipeline(
            self.with_batchnorm_synced(model),
            self.devices,
            self.cfg.microbatches,
            self.split_points,
            "parallel.stages",
        )
        self.layout = pipeline.describe()
        log_layout(self.layout)
        # A module on several devices takes no device_ids; DDP then leaves the inputs where they
        # are and passes (inputs, targets, fn) on to the pipeline.
        return self.replicate(pipeline, device_ids=None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module.model

    def apply(
        self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, fn: LossFn
    ) -> torch.Tensor:
        return model(inputs, targets, fn)

    def report(self) -> dict[str, Any]:
        return self.layout

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        """Process 0's stages, on its share of the batch, each with DDP's gradient buckets."""
        buckets = not self.cfg.gradient_as_bucket_view
        samples = micro_batch // self.world_size
        return stage_shares(
            self.device_type, self.split_points, sizes, samples, self.cfg.microbatches, buckets
        )

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        samples = micro_batch // self.world_size
        return {
            "stage activations": accumulate * boundary_bytes(self.split_points, sizes, samples),
            "gradient all-reduce": ring_bytes(sizes.parameter_bytes, self.world_size),
        }

    def idle_fraction(self) -> float:
        return bubble_fraction(self.cfg.stages, self.cfg.microbatches)
