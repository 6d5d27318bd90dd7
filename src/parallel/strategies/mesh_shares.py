"""What the planner prices a mesh's layout with (`Mesh.cost_model()`: a `LayoutShares`): each
device's share of the model's state and work, and what each rank sends per step, from the
layout's degrees and what `Mesh.check_model` learnt of the model (`ModelSplit`): tp's split
(`tp/costs.py`), cp's share of the sequence and its ring (`cp/costs.py`), the pipeline's
stages (`pp/costs.py`), ep's experts and exchanges (`ep/costs.py`), FSDP2's shards (over
dp_shard x cp) and working set (`dp_shard/costs.py`) and HSDP's replicas' all-reduce
(`dp_replicate/costs.py`). dp_replicate alone is not a mesh: `replicated.DDPCosts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from src.components.batches import Tree
from src.config.parallel import MeshConfig
from src.parallel.cp.costs import (
    ring_activations_kept,
    ring_messages,
    ring_traffic,
    ring_working_set,
)
from src.parallel.dp_replicate.costs import bucketed_all_reduce, replica_traffic
from src.parallel.dp_shard.costs import (
    sharded_messages,
    sharded_share,
    sharded_traffic,
    units_in_forward_order,
)
from src.parallel.ep.costs import (
    ExpertSplit,
    ep_copied_bytes,
    ep_forward_buffers,
    ep_gathered_bytes,
    ep_messages,
    ep_traffic,
)
from src.parallel.layout import Layout
from src.parallel.pp.costs import (
    rank_blocks,
    schedule_bubble,
    stage_blocks,
    stage_messages,
    stage_traffic,
)
from src.parallel.shares import DeviceShare, Messages, ModelSizes
from src.parallel.tp.costs import TPSplit, tp_kept, tp_kept_bytes, tp_messages, tp_traffic


@dataclass(frozen=True)
class ModelSplit:
    """What `Mesh.check_model` learns of the model (on the meta device), once: where the
    pipeline's stages 1.. start and a micro-batch's inputs to trace them with (pp), what tensor
    parallel splits (tp), the experts (ep), and each attention's keys and values per sample
    (cp). A layout without the degree leaves its part empty."""

    stage_points: tuple[int, ...] = ()
    pipeline_inputs: Tree = None
    tp: TPSplit | None = None
    experts: ExpertSplit | None = None
    key_values: tuple[int, ...] = ()


@dataclass(frozen=True)
class LayoutShares:
    """The planner's figures of a mesh's `layout` under its settings `cfg`, for the model as
    `split`; `fsdp`: FSDP2 wraps the model (of one rank too: its parameters are DTensors),
    `shards`: it shards it over dp_shard x cp (set, even of one rank)."""

    cfg: MeshConfig
    layout: Layout
    split: ModelSplit
    device_type: str
    precision: str
    fsdp: bool
    shards: bool

    def stage_blocks(self, blocks: int) -> list[list[tuple[int, int]]]:
        """Each pp rank's stages, as [start, end) ranges of the model's `blocks` blocks."""
        cfg = self.cfg
        return stage_blocks(
            self.split.stage_points, blocks, cfg.schedule, self.layout.pp, cfg.stages_per_rank
        )

    def rank_blocks(self, blocks: int) -> list[list[int]]:
        """The blocks each pp rank holds."""
        return rank_blocks(self.stage_blocks(blocks))

    def kept_bytes(self, sizes: ModelSizes, blocks: list[int]) -> int:
        """The parameter bytes of `blocks` one tp rank holds (before FSDP shards them)."""
        return tp_kept_bytes(self.split.tp, self.layout.tp, sizes, blocks)

    def fsdp_units(self, sizes: ModelSizes) -> list[int]:
        """The bytes of each FSDP unit as one tp rank gathers it (of the experts, its ep
        rank's), in forward order."""
        return [
            ep_gathered_bytes(self.split.experts, unit, self.kept_bytes(sizes, unit))
            for unit in units_in_forward_order(sizes)
        ]

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        """One share per pp rank (the first of its tp and data-parallel peers, which hold as
        much): its stages' blocks on its data-parallel share of the batch, in micro-batches (all
        kept for backward, as GPipe does: 1F1B keeps fewer), its state split by tp and then by
        dp_shard, plus what FSDP holds while the model runs (`running_share`)."""
        layout, count = self.layout, len(sizes.block_parameter_bytes)
        shares = []
        ranks = zip(self.stage_blocks(count), self.rank_blocks(count), strict=True)
        for pp_rank, (ranges, blocks) in enumerate(ranks):
            state_kept, flops_kept, activations_kept = tp_kept(
                self.split.tp, layout.tp, sizes, blocks
            )
            shares.append(
                DeviceShare(
                    f"{self.device_type}:{pp_rank * layout.dp * layout.tp}",
                    micro_batch // layout.dp,
                    blocks=None if ranges == [(0, count)] else ranges[0],
                    later_stages=tuple(ranges[1:]),
                    parts=self.cfg.microbatches if layout.pp > 1 else 1,
                    state_shards=layout.fsdp_shards,
                    state_kept=state_kept,
                    flops_kept=flops_kept / layout.cp,
                    dtensor_parameters=self.dtensor_parameters(blocks),
                    dtensor_layers=self.dtensor_layers(blocks),
                    activations_kept=activations_kept * ring_activations_kept(layout.cp),
                    **self.running_share(sizes, blocks, micro_batch // layout.dp),
                )
            )
        return shares

    def dtensor_parameters(self, blocks: list[int]) -> float:
        """The share of `blocks`' parameter tensors that are DTensors: all under FSDP2, else
        those tensor parallel's styles make DTensors (`TPSplit.distributed_share`)."""
        if self.fsdp:
            return 1.0
        return self.split.tp.distributed_share(blocks) if self.split.tp is not None else 0.0

    def dtensor_layers(self, blocks: list[int]) -> int:
        """The layers of `blocks` that tensor parallel runs on DTensors (`TPSplit`)."""
        if self.split.tp is None:
            return 0
        return sum(self.split.tp.distributed_layers[b] for b in blocks)

    def running_share(self, sizes: ModelSizes, blocks: list[int], samples: int) -> dict[str, Any]:
        """What FSDP (`dp_shard.costs.sharded_share`, where it shards; ep's experts copied where it
        holds them alone, `ep_copied_bytes`), cp's ring (`ring_working_set`) and ep's exchange
        in evaluation (`ep_forward_buffers`) add to the share of a rank holding `blocks`, fed
        `samples` per micro-step."""
        share: dict[str, Any] = {}
        if self.shards:
            held, units = self.kept_bytes(sizes, blocks), self.fsdp_units(sizes)
            staged, shards = self.layout.pp > 1, self.layout.fsdp_shards
            unit_blocks = units_in_forward_order(sizes)
            share = sharded_share(
                units, unit_blocks, held, staged, shards, self.precision, self.device_type
            )
        copied = ep_copied_bytes(self.split.experts, self.precision)
        running = added_bytes(
            share.get("running_bytes", {}), copied, self.ring_working_set(samples, backward=True)
        )
        forward = added_bytes(
            share.get("forward_bytes", {}),
            copied,
            self.ring_working_set(samples, backward=False),
            ep_forward_buffers(self.split.experts, samples, self.precision),
        )
        return {**share, "running_bytes": running, "forward_bytes": forward}

    def ring_working_set(self, samples: int, backward: bool) -> dict[str, int]:
        """What cp's ring adds while the model runs (`ring_working_set`); nothing without cp."""
        layout = self.layout
        if layout.cp == 1:
            return {}
        return ring_working_set(self.split.key_values, samples, layout.cp, layout.tp, backward)

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        """What the busiest rank sends per step over tp (`tp/costs.tp_traffic`), across the
        pipeline's stage boundaries (`pp/costs.py`'s `stage_traffic`) and over data parallel
        (FSDP's `sharded_traffic`, HSDP's replicas' `replica_traffic`). Not counted: the
        sequence-parallel layout changes at the embedding and head, and loss_parallel's
        per-token reductions."""
        layout, samples = self.layout, micro_batch // self.layout.dp
        ranks = self.rank_blocks(len(sizes.block_parameter_bytes))
        staged = layout.pp > 1
        traffic: dict[str, int] = {}
        if self.split.tp is not None:
            sp = self.cfg.sequence_parallel
            tokens = accumulate * samples
            traffic.update(tp_traffic(self.split.tp, layout.tp, ranks, tokens, self.precision, sp))
        if layout.cp > 1:
            traffic.update(
                ring_traffic(self.split.key_values, samples, accumulate, layout.cp, layout.tp)
            )
        if staged:
            traffic.update(stage_traffic(self.split.stage_points, sizes, samples, accumulate))
        if self.split.experts is not None:
            traffic.update(ep_traffic(self.split.experts, accumulate * samples, self.precision))
        held = max(self.kept_bytes(sizes, blocks) for blocks in ranks)
        if self.shards:
            traffic.update(
                sharded_traffic(held, layout.fsdp_shards, accumulate, staged, self.precision)
            )
        if layout.dp_replicate > 1:
            reductions = accumulate if staged else 1
            shard = held // layout.fsdp_shards
            traffic.update(replica_traffic(shard, layout.dp_replicate, reductions))
        return traffic

    def step_messages(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> list[Messages]:
        """The busiest rank's messages per step over tp, pp and data parallel (as
        `step_traffic` counts their bytes)."""
        layout, samples = self.layout, micro_batch // self.layout.dp
        ranks = self.rank_blocks(len(sizes.block_parameter_bytes))
        staged = layout.pp > 1
        parts = self.cfg.microbatches if staged else 1
        runs = accumulate * parts  # the forward and backward passes a rank runs per step
        messages: list[Messages] = []
        if self.split.tp is not None:
            sp, part = self.cfg.sequence_parallel, samples // parts
            messages += tp_messages(self.split.tp, layout.tp, ranks, part, runs, self.precision, sp)
        if layout.cp > 1:
            messages += ring_messages(
                self.split.key_values, samples, accumulate, layout.cp, layout.tp
            )
        if staged:
            messages += stage_messages(
                self.split.stage_points, sizes, samples // parts, runs, layout.pp
            )
        if self.split.experts is not None:
            messages += ep_messages(self.split.experts, samples, runs, self.precision)
        held = max(self.kept_bytes(sizes, blocks) for blocks in ranks)
        if self.shards:  # under pp a rank's stages are one unit, gathered once per micro-step
            units = [self.kept_bytes(sizes, ranks[0])] if staged else self.fsdp_units(sizes)
            shards = layout.fsdp_shards
            messages += sharded_messages(units, shards, accumulate, staged, self.precision)
        if layout.dp_replicate > 1:
            reductions = accumulate if staged else 1
            size = held // layout.fsdp_shards
            messages.append(bucketed_all_reduce(size, layout.dp_replicate, reductions))
        return messages

    def idle_fraction(self) -> float:
        """The pipeline schedule's bubble (none without pp)."""
        if self.layout.pp == 1:
            return 0.0
        return schedule_bubble(self.layout.pp, self.cfg.stages_per_rank, self.cfg.microbatches)


def added_bytes(*parts: dict[str, int]) -> dict[str, int]:
    """Bytes by category, added up over `parts`."""
    total: dict[str, int] = {}
    for part in parts:
        for name, size in part.items():
            total[name] = total.get(name, 0) + size
    return total
