"""An N-D layout of degrees (src/parallel/layout.py) on one DeviceMesh, one process per rank,
adapted to the loop's Strategy interface. The presets fsdp, tp, pp, cp, fsdp_tp, fsdp_cp_tp,
fsdp_tp_pp, ep and mesh are layouts of it (conf/parallel/); dp_replicate alone (ddp, hybrid) is
no mesh: `build_strategy` gives those degrees `replicated.Replicated`, whichever preset names
them.

Launched as torchrun would. The degrees decide the mechanisms: the pipeline cut
(`pp.stages.stage_parts`: the stages this pp rank runs; the other blocks go to the meta
device), tensor parallel (`tp/`, over the whole model) and then FSDP2 over the data-parallel
dimensions (`dp_shard.apply.apply_fsdp`: dp_shard shards, dp_replicate replicates, both HSDP;
under pp, each stage its own FSDP root), with ep's experts split over ep ranks borrowed from
dp_shard (`ep.apply.apply_ep`). Each process then holds part of the gradients, so fp16's
scaler checks them all together (`dp_shard.apply.sharded_scaler`). Under cp each rank runs its
share of every sequence with attention as a ring (`cp.apply.apply_cp`), and FSDP shards over
dp_shard x cp, summing the cp ranks' gradients (of different tokens) and averaging the
data-parallel ranks'.

Data-parallel rank d of D reads `global batch / D` samples; the tp, cp and pp ranks of one
data-parallel index read the same ones and compute the same loss (cp's ranks sum theirs), which
only the data-parallel ranks sum. What `check_model` learns of the model is one frozen
`ModelSplit`; the planner prices the layout with a `LayoutShares` built from it
(`mesh_shares.py`); checkpoints hold single's tensors whatever the layout, through the
`SingleLayoutCheckpoints` that `wrap` builds (`mesh_checkpoints.py`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from src.components.batches import meta_resized, move
from src.config.base import ConfigError
from src.config.parallel import MeshConfig
from src.parallel.base import LossFn, Tree
from src.parallel.cp.apply import apply_cp, check_attention, check_sequence_length, shard_positions
from src.parallel.cp.ring import check_torch_ring, ring_attention
from src.parallel.dp_replicate.apply import check_reducer_options
from src.parallel.dp_shard.apply import (
    apply_fsdp,
    copy_from_rank0,
    divide_gradients_by,
    gradient_sync,
    mixed_precision,
    sharded_scaler,
)
from src.parallel.dtensors import by_mesh, clip_by_whole_norm, held_bytes
from src.parallel.ep.apply import apply_ep, check_degrees, check_experts, resolved_ep
from src.parallel.ep.costs import expert_split
from src.parallel.layout import Layout
from src.parallel.pp.costs import schedule_bubble
from src.parallel.pp.cut import cut_model
from src.parallel.pp.run import PipelineRun
from src.parallel.pp.schedules import check_schedule
from src.parallel.pp.stages import stage_parts
from src.parallel.pp.tied import tied_copies
from src.parallel.stages.hybrid import check_no_stage_cut
from src.parallel.strategies.distributed import Distributed
from src.parallel.strategies.mesh_checkpoints import SingleLayoutCheckpoints, summed
from src.parallel.strategies.mesh_shares import LayoutShares, ModelSplit
from src.parallel.tp.apply import (
    apply_tp,
    check_beside_pipeline,
    checked_styles,
    loss_parallel_kernels,
    split_vocabulary_loss,
)
from src.parallel.tp.costs import tp_split
from src.runtime.ranks import Ranks


class Mesh(Distributed):
    settings_schema = MeshConfig
    sharded_checkpoints = True

    def __init__(self, cfg, device_type: str, precision: str = "fp32", ranks: Ranks | None = None):
        super().__init__(cfg, device_type, precision, ranks)
        check_no_stage_cut(cfg)
        layout = Layout.of_settings(self.world_size, cfg)
        self.layout = replace(layout, ep=resolved_ep(cfg.ep, layout.dp_shard))
        # The degrees as set decide, -1 among them (a degree of one rank is still the preset's
        # mechanism: fsdp on one process shards). tp and pp leave data parallel out when it has
        # one rank; fsdp wraps it anyway, and cp's ranks sum their gradients through it.
        model_split = cfg.tp != 1 or cfg.pp != 1
        self.fsdp = self.layout.dp * self.layout.cp > 1 or not model_split  # FSDP2 wraps it
        self.shards = self.fsdp and cfg.dp_shard * cfg.cp != 1  # and shards it
        check_degrees(self.layout)
        check_reducer_options(cfg, self.layout.label())
        if self.layout.pp > 1:
            check_schedule(cfg.schedule, self.layout.pp, cfg.stages_per_rank, cfg.microbatches)
            check_beside_pipeline(cfg.sequence_parallel, cfg.loss_parallel)
        if self.layout.cp > 1 and self.layout.pp > 1:
            raise ConfigError(
                "parallel.cp does not run with parallel.pp > 1 yet (the pipeline's stages are "
                "shaped for whole sequences); set parallel.cp=1 or parallel.pp=1"
            )
        self.microbatch_samples = 1  # of a pipeline's micro-batch (`check_batch`)
        self.split = ModelSplit()  # what `check_model` learns of the model
        self.saved = SingleLayoutCheckpoints()  # how `wrap` split the model, for checkpoints
        self.run_contexts = contextlib.ExitStack()  # loss_parallel's kernels; cp's ring
        self.pipeline: PipelineRun | None = None
        self.held_bytes = 0  # of the wrapped model, for `report`

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

    @property
    def default_checkpoint_format(self) -> str:
        """`sharded` where the layout shards (dp_shard set, as under fsdp) or no rank holds the
        whole model (tp, pp), else `full` (replicas of FSDP2 over tp or pp of one rank)."""
        splits = self.layout.tp * self.layout.pp * self.layout.dp_shard > 1
        return "sharded" if splits or self.shards else "full"

    def processes_from_settings(self) -> str:
        if not self.data_parallel_only:
            return f"data-parallel degree {self.layout.dp} of layout {self.layout.label()}"
        return super().processes_from_settings()

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

    def check_model(self, model: nn.Module, inputs: Tree) -> None:
        """Each degree's checks of `model` (on the meta device) fed `inputs` (meta), and what
        they learn of it, kept as `self.split`."""
        check_experts(model, self.layout.ep)
        experts = expert_split(model, inputs, self.layout) if self.layout.ep > 1 else None
        stage_points, pipeline_inputs = self.checked_stages(model, inputs)
        options = self.cfg.sequence_parallel, self.cfg.loss_parallel
        styles = checked_styles(model, inputs, self.layout.tp, *options)
        tp = tp_split(model, styles, inputs) if styles is not None else None
        key_values = self.checked_sequences(model, inputs)
        self.split = ModelSplit(stage_points, pipeline_inputs, tp, experts, key_values)

    def checked_stages(self, model: nn.Module, inputs: Tree) -> tuple[tuple[int, ...], Tree]:
        """Under pp, where the stages 1.. start, and a micro-batch of `inputs` to trace them
        with (an nn.Sequential is cut without: None where no inputs are given)."""
        if self.layout.pp == 1:
            return (), None
        example = None if inputs is None else meta_resized(inputs, self.microbatch_samples)
        cut = cut_model(model, self.layout.pp * self.cfg.stages_per_rank, example)
        if not cut.shares_modules and (self.layout.tp > 1 or self.fsdp):
            raise ConfigError(
                f"parallel.pp cuts {type(model).__name__} (not an nn.Sequential) into traced "
                "stages, which tensor parallel and FSDP (parallel.tp, parallel.dp_shard, and "
                "parallel.dp_replicate beside pp) cannot wrap; run pp alone (parallel=pp, "
                "one process per stage), or those without pp"
            )
        return tuple(cut.points), example

    def checked_sequences(self, model: nn.Module, inputs: Tree) -> tuple[int, ...]:
        """Under cp, each attention's keys and values per sample (none without cp)."""
        if self.layout.cp == 1:
            return ()
        check_torch_ring()
        # First: a model without attention has no sequence to cut.
        key_values = check_attention(model, inputs)
        check_sequence_length(inputs.shape[1], self.layout.cp)
        return tuple(key_values)

    def cost_model(self) -> LayoutShares:
        """The planner's figures of this layout for the model `check_model` saw."""
        return LayoutShares(
            self.cfg,
            self.layout,
            self.split,
            self.device_type,
            self.precision,
            self.fsdp,
            self.shards,
        )

    def setup(self) -> None:
        super().setup()
        self.mesh, data_parallel = self.layout.build_mesh(self.device.type)
        self.data_parallel_group = data_parallel.get_group()
        self.run_contexts.enter_context(loss_parallel_kernels(self.cfg.loss_parallel))

    def wrap(self, model: nn.Module) -> nn.Module:
        """Under pp, this rank's stages on its device and the other blocks on the meta device
        (shapes, no memory); tensor parallel over the whole model; then, under pp, each of this
        rank's stages its own FSDP root over the data-parallel ranks (torch's stages drive its
        gradient reduction); else FSDP over the whole model."""
        saved = SingleLayoutCheckpoints.of(model)
        if self.data_parallel_only:  # tp and pp peers see the same samples, or other blocks
            model = self.with_batchnorm_synced(model)
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
                self.split.pipeline_inputs,
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
            row_orders = apply_tp(
                model, self.mesh["tp"], self.cfg.sequence_parallel, self.cfg.loss_parallel
            )
            saved = replace(saved, row_orders=row_orders)
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
        self.saved = replace(saved, pipeline=self.pipeline)
        self.held_bytes = held_bytes(model)
        return model

    def trained_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Under pp, its own stages' parameters only (the others are on the meta device)."""
        return [p for name, p in model.named_parameters() if self.saved.trains(name)]

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
        super().teardown()

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """The gradient reduction put off to the step's last micro-step (FSDP's unsharded
        accumulation); under pp the stages reduce at the end of each micro-step's schedule
        run."""
        if self.fsdp and self.pipeline is None:
            return gradient_sync(model, enabled)
        return contextlib.nullcontext()

    def grad_scaler(self, enabled: bool, init_scale: float) -> torch.amp.GradScaler:
        """Each rank holds part of the gradients (`dp_shard.apply.sharded_scaler`)."""
        return sharded_scaler(self.device_type, enabled, init_scale)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks only: the tp and pp ranks of one hold the same
        value."""
        reduced = tensor.detach().to(self.device, copy=True)
        if self.layout.dp > 1:
            dist.all_reduce(reduced, group=self.data_parallel_group)
        return reduced.to(tensor.device)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.saved.model_state_dict(model)

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        return self.saved.optimizer_state_dict(model, optimizer)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        self.saved.load_optimizer_state_dict(model, optimizer, state)

    def as_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        return self.saved.as_saved(state)

    def place_loaded(self, state: dict[str, Any], saved: dict[str, Any]) -> None:
        self.saved.place_loaded(state, saved)

    def layout_name(self) -> str:
        """The layout as reports name it: `fsdp2xtp2`, `tp2`, `pp2-1F1B` (with its schedule)."""
        label = self.layout.label()
        return f"{label}-{self.cfg.schedule}" if self.layout.pp > 1 else label

    def report(self) -> dict[str, Any]:
        """The layout's name unless the preset's says it; for a pipeline, its schedule's
        theoretical bubble, each pp rank's measured idle fraction (`StageClock`) and the bytes
        of parameters and buffers it holds (`held_bytes`; both collectives of the pp ranks)."""
        named = self.data_parallel_only and self.layout.named_by(self.name)
        figures: dict[str, Any] = {} if named else {"layout": self.layout_name()}
        if self.pipeline is not None:
            figures["pipeline"] = {
                "schedule": self.cfg.schedule,
                "stages": self.layout.pp * self.cfg.stages_per_rank,
                "microbatches": self.cfg.microbatches,
                "bubble_fraction": schedule_bubble(
                    self.layout.pp, self.cfg.stages_per_rank, self.cfg.microbatches
                ),
                "idle_fraction_per_rank": self.pipeline.idle_fractions(),
                "held_bytes_per_rank": self.pipeline.every_rank(self.held_bytes),
            }
        return figures
