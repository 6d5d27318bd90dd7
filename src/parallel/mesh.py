"""Every strategy of one process per rank: an N-D layout of degrees (src/parallel/layout.py)
adapted to the loop's Strategy interface. The presets ddp, fsdp, hybrid, tp, pp, cp, fsdp_tp,
fsdp_cp_tp, fsdp_tp_pp, ep and mesh are layouts of it (conf/parallel/).

One process per rank (per `parallel.stages` devices under the stage cut), launched as torchrun
would. The degrees decide the mechanisms:

- dp_replicate alone (no dp_shard, tp or pp set): torch's DistributedDataParallel (`ddp.py`,
  with the reducer's options), over whole replicas or, with `parallel.stages` > 1, over each
  process's stage cut (`hybrid.py`);
- anything else: the pipeline cut (`pipeline_schedules.stage_parts`: the stages this pp rank
  runs; the other blocks go to the meta device), tensor parallel (`tp/`, over the whole
  model) and then FSDP2 over the data-parallel dimensions (`fsdp.apply_fsdp`: dp_shard shards,
  dp_replicate replicates, both HSDP; under pp, each stage its own FSDP root), with ep's experts
  split over ep ranks borrowed from dp_shard (`expert_parallel.apply_ep`). Each process then
  holds part of the gradients, so fp16's scaler checks them all together (`fsdp.sharded_scaler`).
  Under cp each rank runs its share of every sequence with attention as a ring
  (`context_parallel.apply_cp`), and FSDP shards over dp_shard x cp, summing the cp ranks'
  gradients (of different tokens) and averaging the data-parallel ranks'.

Data-parallel rank d of D reads `global batch / D` samples; the tp, cp and pp ranks of one
data-parallel index read the same ones and compute the same loss (cp's ranks sum theirs), which
only the data-parallel ranks sum. Checkpoints hold single's tensors whatever the layout
(`mesh_checkpoints.py`); the planner's figures come from the degrees (`mesh_shares.py`).
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.components.batches import meta_resized, move
from src.components.state_dicts import tied_keys
from src.config.base import ConfigError
from src.config.parallel import MeshConfig
from src.parallel import ddp, hybrid
from src.parallel.base import LossFn, Tree
from src.parallel.context_parallel import (
    apply_cp,
    check_attention,
    check_sequence_length,
    check_torch_ring,
    ring_attention,
    shard_positions,
)
from src.parallel.distributed import Distributed
from src.parallel.dtensors import by_mesh, clip_by_whole_norm, held_bytes
from src.parallel.expert_parallel import (
    apply_ep,
    check_degrees,
    check_experts,
    expert_split,
    resolved_ep,
)
from src.parallel.fsdp import (
    apply_fsdp,
    copy_from_rank0,
    divide_gradients_by,
    gradient_sync,
    mixed_precision,
    sharded_scaler,
)
from src.parallel.layout import DIMENSIONS, Layout
from src.parallel.mesh_checkpoints import SingleLayoutCheckpoints, summed
from src.parallel.mesh_shares import LayoutShares
from src.parallel.pipeline_cut import cut_model
from src.parallel.pipeline_schedules import (
    PipelineRun,
    check_schedule,
    stage_parts,
    tied_copies,
)
from src.parallel.tp.apply import (
    apply_tp,
    check_beside_pipeline,
    checked_plan,
    loss_parallel_kernels,
    split_vocabulary_loss,
)
from src.parallel.tp.costs import tp_split
from src.parallel.tp.registry import RowOrder
from src.runtime.ranks import Ranks


class Mesh(SingleLayoutCheckpoints, LayoutShares, Distributed):
    settings_schema = MeshConfig
    sharded_checkpoints = True
    replica: DistributedDataParallel | None = None  # the DDP module, for `teardown`

    def __init__(self, cfg, device_type: str, precision: str = "fp32", ranks: Ranks | None = None):
        super().__init__(cfg, device_type, precision, ranks)
        self.processes_per_node = cfg.devices // cfg.stages
        self.world_size = self.processes_per_node * cfg.nodes
        degrees = {name: getattr(cfg, name) for name in DIMENSIONS}
        layout = Layout.of(self.world_size, **degrees)
        self.layout = replace(layout, ep=resolved_ep(cfg.ep, layout.dp_shard))
        # The degrees as set decide, -1 among them (a degree of one rank is still the preset's
        # mechanism: fsdp on one process shards, as ddp on one replicates).
        self.runs_ddp = cfg.dp_shard == cfg.tp == cfg.pp == cfg.cp == 1
        model_split = cfg.tp != 1 or cfg.pp != 1
        # tp and pp leave data parallel out when it has one rank; ddp and fsdp wrap it anyway,
        # and cp's ranks sum their gradients through it.
        wraps_data_parallel = self.layout.dp * self.layout.cp > 1 or not model_split
        self.shards = not self.runs_ddp and wraps_data_parallel and cfg.dp_shard * cfg.cp != 1
        self.fsdp = not self.runs_ddp and wraps_data_parallel
        self.stage_cut = hybrid.stage_cut(cfg, self.world_size, self.runs_ddp)
        check_degrees(self.layout, self.runs_ddp)
        if not self.runs_ddp:
            ddp.check_reducer_options(cfg, self.layout.label())
        if self.layout.pp > 1:
            check_schedule(cfg.schedule, self.layout.pp, cfg.stages_per_rank, cfg.microbatches)
            check_beside_pipeline(cfg.sequence_parallel, cfg.loss_parallel)
        if self.layout.cp > 1 and self.layout.pp > 1:
            raise ConfigError(
                "parallel.cp does not run with parallel.pp > 1 yet (the pipeline's stages are "
                "shaped for whole sequences); set parallel.cp=1 or parallel.pp=1"
            )
        self.row_orders: dict[str, RowOrder] = {}
        self.run_contexts = contextlib.ExitStack()  # loss_parallel's kernels; cp's ring
        self.pipeline: PipelineRun | None = None
        self.held_bytes = 0  # of the wrapped model, for `report`
        self.microbatch_samples = 1  # of a pipeline's micro-batch (`check_batch`)
        self.pipeline_inputs: Tree = None  # a pipeline micro-batch's inputs, meta (`check_model`)
        self.parameter_order: list[str] = []  # the whole model's, as single's optimizer has them
        self.tied: dict[str, str] = {}  # the whole model's tied names (`tied_keys`)

    @property
    def data_shard(self) -> int:
        """Which data-parallel share this process reads (its tp and pp peers read the same)."""
        return self.layout.dp_rank(self.rank)

    @property
    def data_shards(self) -> int:
        return self.layout.dp

    @property
    def data_parallel_only(self) -> bool:
        """Every process a data-parallel rank of its own (no tp, cp or pp)."""
        return self.layout.tp * self.layout.cp * self.layout.pp == 1

    def processes_from_settings(self) -> str:
        cfg = self.cfg
        if not self.data_parallel_only:
            return f"data-parallel degree {self.layout.dp} of layout {self.layout.label()}"
        stages = f" / parallel.stages={cfg.stages}" if self.stage_cut else ""
        return f"parallel.devices={cfg.devices}{stages} x parallel.nodes={cfg.nodes}"

    def check_batch(self, micro_batch: int) -> None:
        super().check_batch(micro_batch)
        share = micro_batch // self.layout.dp
        self.microbatch_samples = max(1, share // self.cfg.microbatches)
        if self.layout.pp > 1 and share % self.cfg.microbatches:
            raise ConfigError(
                f"each data-parallel share of a micro-step ({share} samples) does not split into "
                f"parallel.microbatches={self.cfg.microbatches}; change trainer.batch_size or "
                "parallel.microbatches"
            )
        if self.stage_cut is not None:
            batch = "the batch per process and micro-step (batch_size / accumulate / processes)"
            self.stage_cut.check_samples(share, batch)

    def check_accumulate(self, accumulate: int) -> None:
        ddp.check_accumulate(self.cfg, accumulate)

    def check_model(self, model: nn.Module, inputs: Tree) -> None:
        check_experts(model, self.layout.ep)
        if self.layout.ep > 1:
            self.ep_split = expert_split(model, inputs, self.layout)
        if self.stage_cut is not None:
            self.stage_cut.choose_cuts(model, inputs)
        if self.layout.pp > 1:
            # What the tracer runs (an nn.Sequential is cut without: no inputs may be given).
            if inputs is not None:
                self.pipeline_inputs = meta_resized(inputs, self.microbatch_samples)
            cut = cut_model(model, self.layout.pp * self.cfg.stages_per_rank, self.pipeline_inputs)
            self.stage_points = tuple(cut.points)
            if not cut.shares_modules and (self.layout.tp > 1 or self.fsdp):
                raise ConfigError(
                    f"parallel.pp cuts {type(model).__name__} (not an nn.Sequential) into traced "
                    "stages, which tensor parallel and FSDP (parallel.tp, parallel.dp_shard, and "
                    "parallel.dp_replicate beside pp) cannot wrap; run pp alone (parallel=pp, "
                    "one process per stage), or those without pp"
                )
        options = self.cfg.sequence_parallel, self.cfg.loss_parallel
        plan = checked_plan(model, inputs, self.layout.tp, *options)
        if plan is not None:
            self.split = tp_split(model, plan, inputs)  # what the planner prices
        if self.layout.cp > 1:
            check_torch_ring()
            # First: a model without attention has no sequence to cut.
            self.key_values = check_attention(model, inputs)
            check_sequence_length(inputs.shape[1], self.layout.cp)

    def setup(self) -> None:
        super().setup()
        if not self.runs_ddp:  # DDP reduces over the whole group
            self.mesh, data_parallel = self.layout.build_mesh(self.device.type)
            self.data_parallel_group = data_parallel.get_group()
        self.run_contexts.enter_context(loss_parallel_kernels(self.cfg.loss_parallel))

    def local_devices(self) -> list[torch.device]:
        if self.stage_cut is not None:
            return hybrid.stage_devices(self.device_type, self.local_rank, self.cfg.stages)
        return super().local_devices()

    def wrap(self, model: nn.Module) -> nn.Module:
        self.parameter_order = [name for name, _ in model.named_parameters()]
        self.tied = tied_keys(model)
        if self.data_parallel_only:  # tp and pp peers see the same samples, or other blocks
            model = self.with_batchnorm_synced(model)
        if self.runs_ddp:
            return self.wrap_replica(model)
        return self.wrap_split(model)

    def wrap_replica(self, model: nn.Module) -> nn.Module:
        """DDP over the whole model on this process's device, or over its stage cut (a module on
        several devices takes no device_ids; DDP then leaves the inputs where they are and passes
        (inputs, targets, fn) on to the pipeline)."""
        if self.stage_cut is not None:
            return self.replicate(self.stage_cut.pipeline(model, self.devices), None)
        cuda = self.device.type == "cuda"
        return self.replicate(model.to(self.device), [self.device.index] if cuda else None)

    def replicate(self, module: nn.Module, device_ids: list[int] | None) -> nn.Module:
        """`module` under DDP, kept so that `teardown` can take the process group from it."""
        self.replica = ddp.apply_ddp(module, device_ids, self.cfg)
        return self.replica

    def wrap_split(self, model: nn.Module) -> nn.Module:
        """Under pp, this rank's stages on its device and the other blocks on the meta device
        (shapes, no memory); tensor parallel over the whole model; then, under pp, each of this
        rank's stages its own FSDP root over the data-parallel ranks (torch's stages drive its
        gradient reduction); else FSDP over the whole model."""
        copy_from_rank0(model, self.device)
        data_parallel = self.layout.sharding_mesh(self.mesh)
        policy, offload = mixed_precision(self.precision), self.cfg.offload
        if self.layout.pp > 1:
            pp_mesh = self.mesh["pp"]
            stages = stage_parts(
                model,
                pp_mesh,
                self.cfg.schedule,
                self.cfg.stages_per_rank,
                self.pipeline_inputs,
                self.device,
            )
        else:
            model = model.to(self.device)
        if self.layout.cp > 1:
            shard_positions(model, self.mesh["cp"])
            # Until teardown, for the forward in `apply` and the loop's backward (from here: the
            # trainer's FLOPs count runs the whole model on the meta device before `wrap`).
            self.run_contexts.enter_context(ring_attention(self.mesh["cp"]))
        if self.layout.tp > 1:  # the meta blocks are split too, on no rank's memory
            self.row_orders = apply_tp(
                model, self.mesh["tp"], self.cfg.sequence_parallel, self.cfg.loss_parallel
            )
        if self.layout.ep > 1:  # the experts before the blocks around them
            apply_ep(model, data_parallel, self.layout.ep, policy, offload)
        if self.layout.pp > 1:
            if self.fsdp:
                # Each stage stays gathered from its first forward to the schedule's gradient
                # reduction (its last action on the stage, which reshards it): a split backward
                # (torch's stage_backward_input) finds the weights to differentiate among the
                # stage's registered parameters, which FSDP would have swapped back to the
                # sharded ones after each forward, their gradients then never computed.
                parts = {
                    s: apply_fsdp(
                        part, data_parallel, policy, reshard_after_forward=False, offload=offload
                    )
                    for s, part in stages.parts.items()
                }
                stages = replace(stages, parts=parts)
            tied = tied_copies(model, stages, self.mesh)
            self.pipeline = PipelineRun(self.cfg, pp_mesh, self.device, stages, tied)
        elif self.fsdp:
            model = apply_fsdp(model, data_parallel, policy, offload=offload)
            if self.layout.cp > 1:  # the cp ranks' gradients summed, the data-parallel averaged
                divide_gradients_by(model, self.layout.dp, self.layout.fsdp_shards)
        self.held_bytes = held_bytes(model)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        if not self.runs_ddp:
            return model
        return model.module.model if self.stage_cut is not None else model.module

    def trained_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Under pp, its own stages' parameters only (the others are on the meta device)."""
        return [parameter for name, parameter in model.named_parameters() if self.trains(name)]

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> None:
        """By the norm of all of the model's gradients, as single's: under pp, every pp rank's
        (each holds its own stages'); where they are DTensors on several meshes (ep's dense and
        expert ones, fsdp_tp's split and whole layers) or plain tensors beside DTensors (tp's
        whole norms), whose norms torch cannot stack, each group's norm taken alone; a tied
        tensor's copies (pp), counted once. Gradients of partial sums (sequence parallel's
        norms') are summed first: torch 2.11 takes the norm of each rank's part."""
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad = summed(parameter.grad)
        groups = by_mesh(parameters)
        if self.pipeline is None and len(groups) == 1:
            return super().clip_grad_norm(parameters, max_norm)
        pipeline = self.pipeline
        uncounted, group = (pipeline.uncounted, pipeline.group) if pipeline else (set(), None)
        clip_by_whole_norm(groups, max_norm, uncounted, group)

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        if self.stage_cut is not None:
            return model(inputs, targets, fn)
        if self.pipeline is not None:
            return self.pipeline.run(move(inputs, self.device), move(targets, self.device), fn)
        if self.layout.cp > 1:
            on_shares = functools.partial(self.apply_whole, model)
            return apply_cp(self.mesh["cp"], inputs, targets, fn, on_shares)
        return self.apply_whole(model, inputs, targets, fn)

    def apply_whole(
        self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn
    ) -> torch.Tensor:
        """The forward pass and `fn` on every token of `inputs` this rank holds."""
        if not self.cfg.loss_parallel:
            return super().apply(model, inputs, targets, fn)
        logits = model(move(inputs, self.device))
        return split_vocabulary_loss(logits, move(targets, self.device), self.mesh["tp"], fn)

    def teardown(self) -> None:
        self.run_contexts.close()
        ddp.release_reducer(self.replica)
        super().teardown()

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """The gradient reduction put off to the step's last micro-step (DDP's no_sync, FSDP's
        unsharded accumulation); under pp the stages reduce at the end of each micro-step's
        schedule run."""
        if self.runs_ddp:
            return contextlib.nullcontext() if enabled else model.no_sync()
        if self.fsdp and self.pipeline is None:
            return gradient_sync(model, enabled)
        return contextlib.nullcontext()

    def grad_scaler(self, enabled: bool, init_scale: float) -> torch.amp.GradScaler:
        """DDP's replicas hold whole, equal gradients (the base scaler); any other layout part
        of them (`fsdp.sharded_scaler`)."""
        if self.runs_ddp:
            return super().grad_scaler(enabled, init_scale)
        return sharded_scaler(self.device_type, enabled, init_scale)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks only: the tp and pp ranks of one hold the same value
        (under DDP, every process is one)."""
        if self.runs_ddp:
            return super().all_reduce_sum(tensor)
        reduced = tensor.detach().to(self.device, copy=True)
        if self.layout.dp > 1:
            dist.all_reduce(reduced, group=self.data_parallel_group)
        return reduced.to(tensor.device)

    def layout_name(self) -> str:
        """The layout as reports name it: `fsdp2xtp2`, `tp2`, `pp2-1F1B` (with its schedule)."""
        label = self.layout.label()
        return f"{label}-{self.cfg.schedule}" if self.layout.pp > 1 else label

    def names_its_layout(self) -> bool:
        """Whether the preset's name says the layout already: one data-parallel degree over
        every process (`ddp` for ddp2, `fsdp` for fsdp4) or a job of one process (`single`),
        or the stage cut (hybrid, whose report is its stages), so that reports and sweep tables
        keep the preset's name."""
        if self.stage_cut is not None:
            return True
        one_degree = re.sub(r"\d+", "", self.layout.label())
        return self.data_parallel_only and one_degree in (self.name, "single")

    def report(self) -> dict[str, Any]:
        """The stage cut's stages; the layout's name unless the preset's says it; for a
        pipeline, its schedule's theoretical bubble, each pp rank's measured idle fraction
        (`StageClock`) and the bytes of parameters and buffers it holds (`held_bytes`; both
        collectives of the pp ranks)."""
        if self.stage_cut is not None:
            return self.stage_cut.layout
        figures: dict[str, Any] = {} if self.names_its_layout() else {"layout": self.layout_name()}
        if self.pipeline is not None:
            figures["pipeline"] = {
                "schedule": self.cfg.schedule,
                "stages": self.layout.pp * self.cfg.stages_per_rank,
                "microbatches": self.cfg.microbatches,
                "bubble_fraction": self.idle_fraction(),
                "idle_fraction_per_rank": self.pipeline.idle_fractions(),
                "held_bytes_per_rank": self.pipeline.every_rank(self.held_bytes),
            }
        return figures
