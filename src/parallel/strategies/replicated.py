"""Whole replicas (`parallel=ddp`) or each process's in-process stage cut (`parallel=hybrid`,
`parallel.stages` > 1) under torch's DistributedDataParallel: the layout of dp_replicate alone,
which is not a mesh (one process group, no DTensors).

One process per replica, launched as torchrun would; `build_strategy` picks this class for the
degrees of dp_replicate alone whichever layout preset names them, and `Mesh` for any other.
Each process reads `global batch / replicas` samples; DDP averages the gradients during backward
(`dp_replicate/apply.py`); checkpoints hold single's tensors, as a mesh's do
(`mesh_checkpoints.py`); the planner prices the replica, or its stages, and the all-reduce
(`dp_replicate/costs.py`'s `DDPCosts`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.config.parallel import MeshConfig
from src.parallel.base import LossFn, Tree
from src.parallel.dp_replicate.apply import apply_ddp, check_accumulate, release_reducer
from src.parallel.dp_replicate.costs import DDPCosts
from src.parallel.ep.apply import check_no_experts_under_ddp, resolved_ep
from src.parallel.layout import Layout
from src.parallel.stages import hybrid
from src.parallel.strategies.distributed import Distributed
from src.parallel.strategies.mesh_checkpoints import SingleLayoutCheckpoints
from src.parallel.tp.apply import checked_styles
from src.runtime.ranks import Ranks


class Replicated(Distributed):
    settings_schema = MeshConfig
    sharded_checkpoints = True
    replica: DistributedDataParallel | None = None  # the DDP module, for `teardown`

    def __init__(self, cfg, device_type: str, precision: str = "fp32", ranks: Ranks | None = None):
        super().__init__(cfg, device_type, precision, ranks)
        self.processes_per_node = cfg.devices // cfg.stages
        self.world_size = self.processes_per_node * cfg.nodes
        self.layout = Layout.of_settings(self.world_size, cfg)
        check_no_experts_under_ddp(resolved_ep(cfg.ep, 1))
        self.stage_cut = hybrid.stage_cut(cfg, self.world_size)
        self.saved = SingleLayoutCheckpoints()  # `wrap` gives it the model's names

    def processes_from_settings(self) -> str:
        stages = f" / parallel.stages={self.cfg.stages}" if self.stage_cut else ""
        return f"parallel.devices={self.cfg.devices}{stages} x parallel.nodes={self.cfg.nodes}"

    def check_batch(self, micro_batch: int) -> None:
        super().check_batch(micro_batch)
        if self.stage_cut is not None:
            batch = "the batch per process and micro-step (batch_size / accumulate / processes)"
            self.stage_cut.check_samples(micro_batch // self.layout.dp, batch)

    def check_accumulate(self, accumulate: int) -> None:
        check_accumulate(self.cfg, accumulate)

    def check_model(self, model: nn.Module, inputs: Tree) -> None:
        if self.stage_cut is not None:
            self.stage_cut.choose_cuts(model, inputs)
        # tp's options without tp: refused as under any layout of tp 1.
        checked_styles(model, inputs, 1, self.cfg.sequence_parallel, self.cfg.loss_parallel)

    def cost_model(self) -> DDPCosts:
        buckets = not self.cfg.gradient_as_bucket_view
        cut = self.stage_cut
        stages = cut.costs(self.device_type, buckets) if cut is not None else None
        return DDPCosts(self.cfg, self.device_type, self.layout.dp, stages)

    def local_devices(self) -> list[torch.device]:
        if self.stage_cut is not None:
            return hybrid.stage_devices(self.device_type, self.local_rank, self.cfg.stages)
        return super().local_devices()

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP over the whole model on this process's device, or over its stage cut (a module on
        several devices takes no device_ids; DDP then leaves the inputs where they are and passes
        (inputs, targets, fn) on to the pipeline)."""
        self.saved = SingleLayoutCheckpoints.of(model)
        model = self.with_batchnorm_synced(model)
        if self.stage_cut is not None:
            return self.replicate(self.stage_cut.pipeline(model, self.devices), None)
        cuda = self.device.type == "cuda"
        return self.replicate(model.to(self.device), [self.device.index] if cuda else None)

    def replicate(self, module: nn.Module, device_ids: list[int] | None) -> nn.Module:
        """`module` under DDP, kept so that `teardown` can take the process group from it."""
        self.replica = apply_ddp(module, device_ids, self.cfg)
        return self.replica

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module.model if self.stage_cut is not None else model.module

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        if self.stage_cut is not None:
            return model(inputs, targets, fn)
        return super().apply(model, inputs, targets, fn)

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """The gradient all-reduce put off to the step's last micro-step (DDP's no_sync)."""
        return contextlib.nullcontext() if enabled else model.no_sync()

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.saved.model_state_dict(self.unwrap(model))

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        return self.saved.optimizer_state_dict(self.unwrap(model), optimizer)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        self.saved.load_optimizer_state_dict(self.unwrap(model), optimizer, state)

    def teardown(self) -> None:
        release_reducer(self.replica)
        super().teardown()

    def report(self) -> dict[str, Any]:
        """The stage cut's stages; else the layout's name (`ddp2`) unless the preset's says it
        (`ddp`, or `single` for one process), so that reports and sweep tables keep it."""
        if self.stage_cut is not None:
            return self.stage_cut.layout
        return {} if self.layout.named_by(self.name) else {"layout": self.layout.label()}
