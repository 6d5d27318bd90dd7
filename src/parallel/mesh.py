"""`parallel=tp`, `fsdp_tp`, ...: an N-D layout of degrees (src/parallel/layout.py) on one
DeviceMesh, adapted to the loop's Strategy interface.

One process per rank, launched like ddp. `wrap` applies the pipeline cut (`stage_parts`: the
stages this pp rank runs; the other blocks go to the meta device), tensor parallel (`apply_tp`,
over the whole model) and then FSDP2 over the data-parallel dimensions (`fsdp.apply_fsdp`, with
fsdp's mixed-precision policy: dp_shard shards, dp_replicate replicates, both HSDP; under pp,
each stage its own FSDP root). Each process holds part of the gradients, so fp16's scaler checks
them all together (`grad_scaler`).
Data-parallel rank d of D reads `global batch / D` samples; the tp and pp ranks of one
data-parallel index read the same ones and compute the same loss, which only the data-parallel
ranks sum.

Checkpoints hold single's tensors, in single's row order, whatever the layout. `sharded` (the
default when no rank holds the whole model: tp, pp or dp_shard above 1): every process writes its
own shards through DCP, the pieces of the fused qkv rows that tensor parallel regrouped placed
where they lie in single's tensors, and a pipeline rank the blocks it trains only; any number of
processes of any strategy that reads sharded checkpoints resumes them (DCP reshards); before torch
2.14, whose DCP cannot place those pieces (`dcp_places_rows`), each rank of a qkv tensor's mesh
gathers it whole and DCP writes it once, and reading one, each rank copies its rows out. `full`:
every process gathers the DTensors whole, the regrouping undone (`tensor_parallel.single_layout`),
and rank 0 writes them.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import loss_parallel

from src.checkpoint.store import dcp_places_rows, renamed, rows_placed
from src.components.batches import move
from src.components.precision import AUTOCAST_DTYPES
from src.config.base import ConfigError
from src.config.parallel import MeshConfig
from src.parallel.base import (
    DeviceShare,
    LossFn,
    Messages,
    ModelSizes,
    Tree,
    bucketed_all_reduce,
    ring_bytes,
)
from src.parallel.distributed import Distributed
from src.parallel.fsdp import (
    apply_fsdp,
    copy_from_rank0,
    forward_working_set,
    gathered_bytes,
    gradient_sync,
    mixed_precision,
    parameter_names,
    sharded_messages,
    sharded_traffic,
    units_in_forward_order,
    working_set,
)
from src.parallel.layout import DIMENSIONS, Layout
from src.parallel.mechanisms.stage_pipeline import boundary_bytes
from src.parallel.mesh_plan import TPSplit, tp_split
from src.parallel.pipeline_schedules import (
    PipelineRun,
    check_schedule,
    schedule_bubble,
    stage_parts,
    stage_ranks,
    stage_split,
)
from src.parallel.tensor_parallel import (
    apply_tp,
    check_sequence,
    single_layout,
    tp_layout,
    tp_plan,
)
from src.runtime.ranks import Ranks


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly distributed) tensor, on the CPU (a collective for a
    DTensor: every rank calls it)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def held_bytes(model: nn.Module) -> int:
    """The bytes of `model`'s parameters and buffers in this process's memory: its local shards
    of DTensors, nothing of a tensor on the meta device."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.nbytes for t in local if not t.is_meta)


def like(parameter: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` distributed as `parameter` is (this rank's shard of it)."""
    if not isinstance(parameter, DTensor):
        return full.to(parameter.device)
    full = full.to(parameter.device_mesh.device_type)
    return distribute_tensor(full, parameter.device_mesh, parameter.placements)


class Mesh(Distributed):
    settings_schema = MeshConfig
    sharded_checkpoints = True
    # What check_model finds for the planner: where stages 1.. start, what tp splits.
    stage_points: tuple[int, ...] = ()
    split: TPSplit | None = None

    def __init__(self, cfg, device_type: str, precision: str = "fp32", ranks: Ranks | None = None):
        super().__init__(cfg, device_type, precision, ranks)
        degrees = {name: getattr(cfg, name) for name in DIMENSIONS}
        self.layout = Layout.of(self.world_size, **degrees)
        if self.layout.pp > 1:
            check_schedule(cfg.schedule, self.layout.pp, cfg.stages_per_rank, cfg.microbatches)
            if cfg.sequence_parallel or cfg.loss_parallel:
                raise ConfigError(
                    "parallel.sequence_parallel and parallel.loss_parallel do not run with "
                    "parallel.pp > 1 yet; set them to false, or parallel.pp=1"
                )
        self.row_orders: dict[str, torch.Tensor] = {}
        self.loss_kernels = contextlib.ExitStack()
        self.pipeline: PipelineRun | None = None
        self.held_bytes = 0  # of the wrapped model, for `report`
        self.parameter_order: list[str] = []  # the whole model's, as single's optimizer has them

    @property
    def data_shard(self) -> int:
        """Which data-parallel share this process reads (its tp and pp peers read the same)."""
        return self.layout.dp_rank(self.rank)

    @property
    def data_shards(self) -> int:
        return self.layout.dp

    def processes_from_settings(self) -> str:
        return f"data-parallel degree {self.layout.dp} of layout {self.layout.label()}"

    def check_batch(self, micro_batch: int) -> None:
        super().check_batch(micro_batch)
        share = micro_batch // self.layout.dp
        if self.layout.pp > 1 and share % self.cfg.microbatches:
            raise ConfigError(
                f"each data-parallel share of a micro-step ({share} samples) does not split into "
                f"parallel.microbatches={self.cfg.microbatches}; change trainer.batch_size or "
                "parallel.microbatches"
            )

    def check_model(self, model: nn.Module, inputs: Tree) -> None:
        if self.layout.pp > 1:
            self.stage_points = tuple(stage_split(model, self.layout.pp * self.cfg.stages_per_rank))
        if self.layout.tp > 1:
            plan = tp_plan(
                model, self.layout.tp, self.cfg.sequence_parallel, self.cfg.loss_parallel
            )
            if self.cfg.sequence_parallel:
                check_sequence(inputs, self.layout.tp)
            self.split = tp_split(model, plan, inputs)
        elif self.cfg.sequence_parallel or self.cfg.loss_parallel:
            raise ConfigError(
                "parallel.sequence_parallel and parallel.loss_parallel need tensor parallel; set "
                "parallel.tp to 2 or more"
            )

    def setup(self) -> None:
        super().setup()
        self.mesh = self.layout.build_mesh(self.device.type)
        if self.cfg.loss_parallel:
            # Its cross-entropy kernels for the forward in `apply` and the loop's backward.
            self.loss_kernels.enter_context(loss_parallel())

    def wrap(self, model: nn.Module) -> nn.Module:
        """Under pp, this rank's stages on its device and the other blocks on the meta device
        (shapes, no memory); tensor parallel over the whole model; then, under pp, each of this
        rank's stages its own FSDP root over the data-parallel ranks (torch's stages drive its
        gradient reduction); else FSDP over the whole model."""
        self.parameter_order = [name for name, _ in model.named_parameters()]
        copy_from_rank0(model, self.device)
        data_parallel = self.mesh["dp_replicate", "dp_shard"]
        policy, offload = mixed_precision(self.precision), self.cfg.offload
        if self.layout.pp > 1:
            pp_mesh = self.mesh["pp"]
            parts, block_ranks = stage_parts(
                model, pp_mesh, self.cfg.schedule, self.cfg.stages_per_rank
            )
            kept = {id(block) for part in parts.values() for block in part}
            for block in model:
                block.to(self.device if id(block) in kept else "meta")
        else:
            model = model.to(self.device)
        if self.layout.tp > 1:  # the meta blocks are split too, on no rank's memory
            self.row_orders = apply_tp(
                model, self.mesh["tp"], self.cfg.sequence_parallel, self.cfg.loss_parallel
            )
        if self.layout.pp > 1:
            if self.layout.dp > 1:
                # Each stage stays gathered from its first forward to the schedule's gradient
                # reduction (its last action on the stage, which reshards it): a split backward
                # (torch's stage_backward_input) finds the weights to differentiate among the
                # stage's registered parameters, which FSDP would have swapped back to the
                # sharded ones after each forward, their gradients then never computed.
                parts = {
                    s: apply_fsdp(
                        part, data_parallel, policy, reshard_after_forward=False, offload=offload
                    )
                    for s, part in parts.items()
                }
            self.pipeline = PipelineRun(self.cfg, pp_mesh, self.device, parts, block_ranks)
        elif self.layout.dp > 1:
            model = apply_fsdp(model, data_parallel, policy, offload=offload)
        self.held_bytes = held_bytes(model)
        return model

    def trained_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Under pp, its own stages' parameters only (the others are on the meta device)."""
        return [parameter for name, parameter in model.named_parameters() if self.trains(name)]

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: float) -> None:
        """Under pp, by the norm of every pp rank's gradients (each holds its own stages'), as
        single's is of the whole model's."""
        if self.pipeline is None:
            return super().clip_grad_norm(parameters, max_norm)
        gradients = [p.grad for p in parameters if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(gradients)
        squared = (norm.full_tensor() if isinstance(norm, DTensor) else norm).square()
        dist.all_reduce(squared, group=self.pipeline.group)
        with implicit_replication():  # the norm, a plain tensor, scales DTensor gradients too
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, squared.sqrt())

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        if self.pipeline is not None:
            return self.pipeline.run(move(inputs, self.device), move(targets, self.device), fn)
        if not self.cfg.loss_parallel:
            return super().apply(model, inputs, targets, fn)
        # The logits are a DTensor split over the vocabulary; the targets, whole on every tp
        # rank, become a replicated one beside them, and the sums whole tensors again.
        targets = DTensor.from_local(move(targets, self.device), self.mesh["tp"], [Replicate()])
        return fn(model(move(inputs, self.device)), targets).full_tensor()

    def teardown(self) -> None:
        self.loss_kernels.close()
        super().teardown()

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """FSDP's gradient reduction put off to the step's last micro-step; under pp the stages
        reduce at the end of each micro-step's schedule run."""
        if self.layout.dp > 1 and self.pipeline is None:
            return gradient_sync(model, enabled)
        return contextlib.nullcontext()

    def grad_scaler(self, enabled: bool, init_scale: float) -> torch.amp.GradScaler:
        """A process holds part of the gradients (its dp_shard's shards, its tp rank's split of a
        layer, its pp rank's stages): ShardedGradScaler all-reduces the inf/NaN check over every
        process, so that all skip the step when any part overflowed (each checking its own, one
        rank would step where another skipped, and their loss scales part)."""
        return ShardedGradScaler(self.device_type, init_scale=init_scale, enabled=enabled)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks only: the tp ranks of one hold the same value."""
        reduced = tensor.detach().to(self.device, copy=True)
        if self.layout.dp > 1:
            dist.all_reduce(reduced, group=self.mesh["dp"].get_group())
        return reduced.to(tensor.device)

    @property
    def default_checkpoint_format(self) -> str:
        """`sharded` where no rank holds the whole model (as under fsdp), else `full`."""
        layout = self.layout
        return "sharded" if layout.tp * layout.pp * layout.dp_shard > 1 else "full"

    def trains(self, name: str) -> bool:
        """Whether this process trains (and holds) the state_dict entry `name`: under pp, only
        the entries of its stages' blocks."""
        if self.pipeline is None:
            return True
        return self.pipeline.block_ranks[int(name.split(".")[0])] == self.pipeline.rank

    def as_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """The entries this process trains, each in single's layout (`in_single_rows`), and the
        optimizer's groups as single's (`single_groups`), if the state has an optimizer."""
        saved = {
            "model": {
                name: self.in_single_rows(name, value)
                for name, value in state["model"].items()
                if self.trains(name)
            }
        }
        if "optimizer" in state:
            optimizer_state = state["optimizer"]
            saved["optimizer"] = {
                "state": {
                    name: {key: self.in_single_rows(name, value) for key, value in entries.items()}
                    for name, entries in optimizer_state["state"].items()
                    if self.trains(name)
                },
                "param_groups": self.single_groups(optimizer_state["param_groups"]),
            }
        return saved

    def single_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (parameters by name) as single's: under pp, each
        group's parameters on every pp rank, in the model's order (a collective of the pp
        ranks), copied: DCP loads into them, and the optimizer keeps its own."""
        if self.pipeline is None:
            return groups
        every = self.pipeline.every_rank([group["params"] for group in groups])
        return [
            {**group, "params": [n for n in self.parameter_order if any(n in p[g] for p in every)]}
            for g, group in enumerate(groups)
        ]

    def in_single_rows(self, name: str, value: Any) -> Any:
        """A regrouped qkv tensor's local shard (a contiguous block of regrouped rows) as the
        rows of single's tensor it holds; a DTensor of partial sums (the momentum of a norm
        under sequence parallel: its gradients' sum left pending) summed, as DCP saves no
        partial values; any other value as it is."""
        if not isinstance(value, DTensor):
            return value
        if any(placement.is_partial() for placement in value.placements):
            summed = [Replicate() if p.is_partial() else p for p in value.placements]
            value = value.redistribute(placements=summed)
        if name not in self.row_orders:
            return value
        if not dcp_places_rows():  # the whole tensor, every rank of its mesh alike (DCP: once)
            return single_layout(name, full_tensor(value), self.row_orders)
        return rows_placed(value.to_local(), self.local_rows(name, value), value.shape)

    def local_rows(self, name: str, value: DTensor) -> list[int]:
        """The rows of single's tensor `name` that this rank's shard of a regrouped qkv tensor
        holds, in the shard's order."""
        (chunk,) = value.__create_chunk_list__()  # where this shard lies, in regrouped rows
        start, count = chunk.offsets[0], chunk.sizes[0]
        return self.row_orders[name][start : start + count].tolist()

    def place_loaded(self, state: dict[str, Any], saved: dict[str, Any]) -> None:
        """Where DCP cannot place the rows itself (`dcp_places_rows`), each regrouped qkv
        tensor was read whole, in single's layout: this rank's rows go into its shard."""
        if dcp_places_rows():
            return
        model, optimizer = saved["model"], saved["optimizer"]["state"]
        read = [
            (name, value, model[name]) for name, value in state["model"].items() if name in model
        ]
        read += [
            (name, value, optimizer[name][key])
            for name, entries in state["optimizer"]["state"].items()
            if name in optimizer
            for key, value in entries.items()
        ]
        for name, value, whole in read:
            if name in self.row_orders and isinstance(value, DTensor):
                local = value.to_local()
                local.copy_(whole[self.local_rows(name, value)].to(local.device))

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Single's state_dict: under pp, the entries of blocks this rank does not hold (meta) are
        filled from the ranks that do (`PipelineRun.gathered`)."""
        state = {
            name: single_layout(name, full_tensor(value), self.row_orders)
            if self.trains(name)
            else value
            for name, value in model.state_dict().items()
        }
        return self.pipeline.gathered(state) if self.pipeline else state

    def single_order(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """The parameters in single's optimizer order, which numbers its state: each group's
        parameters in the model's order (`single_groups`), group after group."""
        names = iter(parameter_names(model, optimizer))
        groups = [
            {"params": [next(names) for _ in group["params"]]} for group in optimizer.param_groups
        ]
        return [name for group in self.single_groups(groups) for name in group["params"]]

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Single's format: state by single's parameter index, each tensor whole, in single's
        layout; under pp, every rank's (each optimizer holds its own stages' parameters)."""
        names = parameter_names(model, optimizer)
        state = optimizer.state_dict()
        state["state"] = {
            index: {
                key: single_layout(names[index], full_tensor(value), self.row_orders)
                if isinstance(value, torch.Tensor) and value.dim() > 0
                else value
                for key, value in entries.items()
            }
            for index, entries in state["state"].items()
        }
        single = {name: index for index, name in enumerate(self.single_order(model, optimizer))}
        state = renamed(state, {index: single[name] for index, name in enumerate(names)})
        return self.pipeline.merged(state) if self.pipeline else state

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Single's optimizer state: under pp, the entries of this rank's parameters only."""
        local = {name: index for index, name in enumerate(parameter_names(model, optimizer))}
        names = dict(enumerate(self.single_order(model, optimizer)))
        parameters = dict(model.named_parameters())
        own = {index: name for index, name in names.items() if name in local}
        state = {
            "state": {
                local[own[index]]: {
                    key: like(parameters[own[index]], tp_layout(own[index], value, self.row_orders))
                    if isinstance(value, torch.Tensor) and value.dim() > 0
                    else value
                    for key, value in entries.items()
                }
                for index, entries in state["state"].items()
                if index in own
            },
            "param_groups": [
                {**group, "params": [local[own[i]] for i in group["params"] if i in own]}
                for group in state["param_groups"]
            ],
        }
        optimizer.load_state_dict(state)

    def layout_name(self) -> str:
        """The layout as reports name it: `fsdp2xtp2`, `tp2`, `pp2-1F1B` (with its schedule)."""
        label = self.layout.label()
        return f"{label}-{self.cfg.schedule}" if self.layout.pp > 1 else label

    def report(self) -> dict[str, Any]:
        """The layout's name; for a pipeline, its schedule's theoretical bubble, each pp rank's
        measured idle fraction (`StageClock`) and the bytes of parameters and buffers it holds
        (`held_bytes`; both collectives of the pp ranks)."""
        figures: dict[str, Any] = {"layout": self.layout_name()}
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

    # ----------------------------------------------------------------------- for the planner

    def stage_blocks(self, blocks: int) -> list[list[tuple[int, int]]]:
        """Each pp rank's stages, as [start, end) ranges of the model's `blocks` blocks."""
        bounds = [0, *self.stage_points, blocks]
        owner = stage_ranks(self.cfg.schedule, self.layout.pp, self.cfg.stages_per_rank)
        return [
            [(bounds[s], bounds[s + 1]) for s, held_by in enumerate(owner) if held_by == rank]
            for rank in range(self.layout.pp)
        ]

    def rank_blocks(self, blocks: int) -> list[list[int]]:
        """The blocks each pp rank holds."""
        return [
            [b for start, end in ranges for b in range(start, end)]
            for ranges in self.stage_blocks(blocks)
        ]

    def kept_bytes(self, sizes: ModelSizes, blocks: list[int]) -> int:
        """The parameter bytes of `blocks` one tp rank holds (before FSDP shards them)."""
        whole = sum(sizes.block_parameter_bytes[b] for b in blocks)
        if self.split is None:
            return whole
        split = sum(self.split.split_parameter_bytes[b] for b in blocks)
        return int(whole - (1 - 1 / self.layout.tp) * split)

    def tp_kept(self, sizes: ModelSizes, blocks: list[int]) -> tuple[float, float]:
        """The shares of `blocks`' parameters (and so gradients and optimizer state) and of their
        FLOPs that one tp rank keeps."""
        if self.split is None:
            return 1.0, 1.0
        whole = sum(sizes.block_parameter_bytes[b] for b in blocks)
        state_kept = self.kept_bytes(sizes, blocks) / whole if whole else 1.0
        return state_kept, self.split.flops_kept(blocks, self.layout.tp)

    def activations_kept(self, blocks: list[int]) -> float:
        """The share of `blocks`' traced activations one tp rank holds (tp splits those inside
        its pairs: traced whole, they overstated a tp rank's peak by a third on a tiny GPT)."""
        return 1.0 if self.split is None else self.split.activations_kept(blocks, self.layout.tp)

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        """One share per pp rank (the first of its tp and data-parallel peers, which hold as
        much): its stages' blocks on its data-parallel share of the batch, in micro-batches (all
        kept for backward, as GPipe does: 1F1B keeps fewer), its state split by tp and then by
        dp_shard, plus what FSDP holds while the model runs (`fsdp_working_set`)."""
        layout, count = self.layout, len(sizes.block_parameter_bytes)
        shares = []
        ranks = zip(self.stage_blocks(count), self.rank_blocks(count), strict=True)
        for pp_rank, (ranges, blocks) in enumerate(ranks):
            state_kept, flops_kept = self.tp_kept(sizes, blocks)
            shares.append(
                DeviceShare(
                    f"{self.device_type}:{pp_rank * layout.dp * layout.tp}",
                    micro_batch // layout.dp,
                    blocks=None if ranges == [(0, count)] else ranges[0],
                    later_stages=tuple(ranges[1:]),
                    parts=self.cfg.microbatches if layout.pp > 1 else 1,
                    state_shards=layout.dp_shard,
                    state_kept=state_kept,
                    flops_kept=flops_kept,
                    activations_kept=self.activations_kept(blocks),
                    running_bytes=self.fsdp_working_set(sizes, blocks),
                    forward_bytes=self.fsdp_forward_working_set(sizes, blocks),
                )
            )
        return shares

    def fsdp_working_set(self, sizes: ModelSizes, blocks: list[int]) -> dict[str, int]:
        """What FSDP adds while the model runs to a rank holding `blocks`: under pp all of its
        stages gathered (they stay so through the schedule's run: `wrap`), else
        `fsdp.working_set` of its units as a tp rank keeps them; nothing without dp_shard.
        Gathered in the autocast dtype under bf16/fp16 (`fsdp.mixed_precision`)."""
        if self.layout.dp_shard == 1:
            return {}
        if self.layout.pp > 1:
            return {"parameters": gathered_bytes(self.kept_bytes(sizes, blocks), self.precision)}
        units = [self.kept_bytes(sizes, unit) for unit in units_in_forward_order(sizes)]
        gathered_units = [gathered_bytes(unit, self.precision) for unit in units]
        gathered, reduced = working_set(
            gathered_units, units, self.layout.dp_shard, self.device_type
        )
        return {"parameters": gathered, "gradients": reduced}

    def fsdp_forward_working_set(self, sizes: ModelSizes, blocks: list[int]) -> dict[str, int]:
        """What FSDP adds to a rank holding `blocks` while the model runs forward alone
        (evaluation): as `fsdp_working_set`, with `fsdp.forward_working_set` of the units."""
        if self.layout.dp_shard == 1 or self.layout.pp > 1:
            return self.fsdp_working_set(sizes, blocks)
        units = [self.kept_bytes(sizes, unit) for unit in units_in_forward_order(sizes)]
        return {
            "parameters": forward_working_set([gathered_bytes(u, self.precision) for u in units])
        }

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        """What the busiest rank sends per step over tp (each pair's all-reduce forward and
        backward; with sequence_parallel an all-gather and a reduce-scatter each way, as much
        together) and data parallel (FSDP's, and the replicas' gradient all-reduce; under pp
        each micro-step's schedule run gathers a stage once and reduces its gradients), and what
        crosses the pipeline's stage boundaries (activations forward, gradients back). Not
        counted: the sequence-parallel layout changes at the embedding and head, and
        loss_parallel's per-token reductions."""
        layout, samples = self.layout, micro_batch // self.layout.dp
        ranks = self.rank_blocks(len(sizes.block_parameter_bytes))
        traffic: dict[str, int] = {}
        if self.split is not None:
            summed = max(
                sum(size for block, size in self.split.pair_outputs if block in blocks)
                for blocks in ranks
            )
            size = accumulate * samples * summed
            if self.precision in AUTOCAST_DTYPES:  # the Linears' outputs, in the autocast dtype
                size //= 2
            if self.cfg.sequence_parallel:
                each = int(2 * (layout.tp - 1) / layout.tp * size)
                traffic.update({"activation all-gather": each, "activation reduce-scatter": each})
            else:
                traffic["activation all-reduce"] = 2 * ring_bytes(size, layout.tp)
        if layout.pp > 1:
            crossing = boundary_bytes(self.stage_points, sizes, samples)
            traffic["stage activations"] = accumulate * crossing
        held = max(self.kept_bytes(sizes, blocks) for blocks in ranks)
        reductions = accumulate if layout.pp > 1 else 1
        if layout.dp_shard > 1:
            gathers = 1 if layout.pp > 1 else 2
            gathered = gathered_bytes(held, self.precision)
            traffic.update(
                sharded_traffic(gathered, held, layout.dp_shard, accumulate, gathers, reductions)
            )
        if layout.dp_replicate > 1:
            traffic["gradient all-reduce"] = reductions * ring_bytes(
                held // layout.dp_shard, layout.dp_replicate
            )
        return traffic

    def step_messages(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> list[Messages]:
        """The busiest rank's messages per step over tp, pp and data parallel (as
        `step_traffic` counts their bytes)."""
        layout, samples = self.layout, micro_batch // self.layout.dp
        ranks = self.rank_blocks(len(sizes.block_parameter_bytes))
        parts = self.cfg.microbatches if layout.pp > 1 else 1
        runs = accumulate * parts  # the forward and backward passes a rank runs per step
        messages = self.tp_messages(ranks, samples // parts, runs) if self.split else []
        if layout.pp > 1:
            # each boundary a rank's stages touch: activations forward, gradients back, per run
            boundaries = -(-2 * len(self.stage_points) // layout.pp)
            crossing = boundary_bytes(self.stage_points, sizes, samples // parts)
            each = crossing // (2 * len(self.stage_points))  # one way over one boundary
            messages.append(Messages("send", 2 * runs * boundaries, each, 2))
        held = max(self.kept_bytes(sizes, blocks) for blocks in ranks)
        reductions = accumulate if layout.pp > 1 else 1
        if layout.dp_shard > 1:
            if layout.pp > 1:  # a rank's stages gathered once per micro-step
                units = [self.kept_bytes(sizes, blocks) for blocks in ranks[:1]]
            else:
                units = [self.kept_bytes(sizes, unit) for unit in units_in_forward_order(sizes)]
            gathered = [gathered_bytes(unit, self.precision) for unit in units]
            gathers = 1 if layout.pp > 1 else 2
            messages += sharded_messages(
                gathered, units, layout.dp_shard, accumulate, gathers, reductions
            )
        if layout.dp_replicate > 1:
            size = held // layout.dp_shard
            messages.append(bucketed_all_reduce(size, layout.dp_replicate, reductions))
        return messages

    def tp_messages(self, ranks: list[list[int]], samples: int, runs: int) -> list[Messages]:
        """The busiest rank's tp messages in `runs` passes of `samples` samples: each pair's
        all-reduce forward and backward (with sequence_parallel, an all-gather and a
        reduce-scatter each way), which the next layer waits for."""
        pairs = max(
            (
                [size for block, size in self.split.pair_outputs if block in blocks]
                for blocks in ranks
            ),
            key=sum,
        )
        if not pairs:
            return []
        size = samples * sum(pairs) // len(pairs)
        if self.precision in AUTOCAST_DTYPES:  # the Linears' outputs, in the autocast dtype
            size //= 2
        tp, count = self.layout.tp, 2 * len(pairs) * runs
        if self.cfg.sequence_parallel:
            return [
                Messages("all_gather", count, size, tp),
                Messages("reduce_scatter", count, size, tp),
            ]
        return [Messages("all_reduce", count, size, tp)]

    def idle_fraction(self) -> float:
        if self.layout.pp == 1:
            return 0.0
        return schedule_bubble(self.layout.pp, self.cfg.stages_per_rank, self.cfg.microbatches)
