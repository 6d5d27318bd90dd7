"""`parallel=hybrid`: DDP across processes, each process running the model as a pipeline.

Composed of the two: ddp's processes (`DDP`: launching, logging, rank-0 writing, failures, the
gradient all-reduce) and, in each, model_parallel's `StageCut` over `parallel.stages` devices.
`parallel.devices / parallel.stages` processes per node; process p drives GPUs
p * stages .. p * stages + stages - 1 (on CPU: `stages` CPU stages), where its copy of the model
is cut into stages as in `model_parallel` (same split points, same micro-batching). DDP wraps
each process's `Pipeline` as one multi-device module (`device_ids=None`) and averages its
gradients across the processes, as `ddp` does for whole replicas.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from src.components.batches import Tree
from src.config.base import ConfigError
from src.config.parallel import HybridConfig
from src.parallel.base import DeviceShare, LossFn, ModelSizes, ring_bytes
from src.parallel.ddp import DDP
from src.parallel.stage_cut import StageCut
from src.runtime.ranks import Ranks


class Hybrid(DDP):
    settings_schema = HybridConfig

    def __init__(self, cfg, device_type: str, precision: str = "fp32", ranks: Ranks | None = None):
        super().__init__(cfg, device_type, precision, ranks)
        self.stage_cut = StageCut(cfg, cfg.stages, "parallel.stages")
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

    def check_batch(self, micro_batch: int) -> None:
        super().check_batch(micro_batch)
        batch = "the batch per process and micro-step (batch_size / accumulate / processes)"
        self.stage_cut.check_samples(micro_batch // self.world_size, batch)

    def check_model(self, model: nn.Module, inputs: Tree) -> None:
        self.stage_cut.plan(model, inputs, self.device_type)

    def local_devices(self) -> list[torch.device]:
        if self.device_type == "cuda":
            # Modulo the visible GPUs: under `srun --gpus-per-task=<stages>` a rank sees its own.
            first = self.local_rank * self.cfg.stages % torch.cuda.device_count()
            return [torch.device("cuda", first + i) for i in range(self.cfg.stages)]
        return [torch.device("cpu")] * self.cfg.stages

    def wrap(self, model: nn.Module) -> nn.Module:
        # A module on several devices takes no device_ids; DDP then leaves the inputs where they
        # are and passes (inputs, targets, fn) on to the pipeline.
        pipeline = self.stage_cut.pipeline(self.with_batchnorm_synced(model), self.devices)
        return self.replicate(pipeline, device_ids=None)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module.model

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        return model(inputs, targets, fn)

    def report(self) -> dict[str, Any]:
        return self.stage_cut.layout

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        """The first process's stages, on its share of the batch, each with DDP's buckets (a
        second copy of its gradients) unless the gradients are views into them."""
        samples, buckets = micro_batch // self.world_size, not self.cfg.gradient_as_bucket_view
        return self.stage_cut.device_shares(self.device_type, sizes, samples, buckets)

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        samples = micro_batch // self.world_size
        return {
            **self.stage_cut.step_traffic(sizes, samples, accumulate),
            "gradient all-reduce": ring_bytes(sizes.parameter_bytes, self.world_size),
        }

    def idle_fraction(self) -> float:
        return self.stage_cut.idle_fraction()
