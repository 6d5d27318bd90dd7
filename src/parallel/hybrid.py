"""`parallel=hybrid`: DDP across processes, each process running the model as a pipeline.

`parallel.devices / parallel.stages` processes per node; process p drives GPUs
p * stages .. p * stages + stages - 1 (on CPU: `stages` CPU stages), where its copy of the model
is cut into stages as in `model_parallel` (same split points, same micro-batching). DDP wraps
each process's `Pipeline` as one multi-device module (`device_ids=None`) and averages its
gradients across the processes, as `ddp` does for whole replicas. Launching, logging, rank-0
writing and failures are `ddp`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from src.config.schema import ConfigError
from src.parallel.base import ModelSizes, ring_bytes
from src.parallel.ddp import DDP
from src.parallel.pipelined import Pipelined
from src.runtime.ranks import Ranks


class Hybrid(Pipelined, DDP):
    stages_setting = "parallel.stages"

    def __init__(
        self, cfg, device_type: str, precision: str = "fp32", ranks: Ranks | None = None
    ):
        if cfg.stages < 1:
            raise ConfigError(f"parallel.stages must be at least 1, got {cfg.stages}")
        if cfg.devices % cfg.stages:
            raise ConfigError(
                f"parallel.devices={cfg.devices} does not divide into processes of "
                f"parallel.stages={cfg.stages} devices each; make parallel.devices a multiple of "
                "parallel.stages"
            )
        super().__init__(cfg, device_type, precision, ranks)
        self.processes_per_node = cfg.devices // cfg.stages
        self.world_size = self.processes_per_node * cfg.nodes
        if self.world_size == 1:
            raise ConfigError(
                f"parallel=hybrid with parallel.devices={cfg.devices} and parallel.stages="
                f"{cfg.stages} is a single process, with nothing to run data-parallel: use "
                f"parallel=model_parallel parallel.devices={cfg.stages}, or raise parallel.devices "
                "to a multiple of parallel.stages"
            )

    def processes_from_settings(self) -> str:
        cfg = self.cfg
        return (
            f"parallel.devices={cfg.devices} / parallel.stages={cfg.stages} x "
            f"parallel.nodes={cfg.nodes}"
        )

    def local_devices(self) -> list[torch.device]:
        if self.device_type == "cuda":
            # Modulo the visible GPUs: under `srun --gpus-per-task=<stages>` a rank sees its own.
            first = self.local_rank * self.cfg.stages % torch.cuda.device_count()
            return [torch.device("cuda", first + i) for i in range(self.cfg.stages)]
        return [torch.device("cpu")] * self.cfg.stages

    def wrap(self, model: nn.Module) -> nn.Module:
        # A module on several devices takes no device_ids; DDP then leaves the inputs where they
        # are and passes (inputs, targets, fn) on to the pipeline.
        return self.replicate(self.pipeline(self.with_batchnorm_synced(model)), device_ids=None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module.model

    def gradient_buckets(self) -> bool:
        return not self.cfg.gradient_as_bucket_view

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        return {
            **super().step_traffic(sizes, micro_batch, accumulate),
            "gradient all-reduce": ring_bytes(sizes.parameter_bytes, self.world_size),
        }
