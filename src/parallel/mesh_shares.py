"""What the planner needs of a layout (`Mesh` takes these methods from `LayoutShares`): each
device's share of the model's state and work, and what each rank sends per step, from the
layout's degrees whichever preset named them: dp_replicate alone DDP's (`ddp.py`: a replica and
its buckets; under the stage cut, its stages: `stage_cut.py`), else tp's split (`mesh_plan.py`),
the pipeline's stages (`pipeline_schedules.py`) and FSDP2's shards and working set (`fsdp.py`).
"""

from __future__ import annotations

from src.components.precision import AUTOCAST_DTYPES
from src.config.parallel import MeshConfig
from src.parallel.ddp import bucket_bytes, ddp_traffic
from src.parallel.fsdp import (
    forward_working_set,
    gathered_bytes,
    sharded_messages,
    sharded_traffic,
    units_in_forward_order,
    working_set,
)
from src.parallel.layout import Layout
from src.parallel.mechanisms.stage_pipeline import boundary_bytes
from src.parallel.mesh_plan import TPSplit
from src.parallel.pipeline_schedules import schedule_bubble, stage_ranks
from src.parallel.shares import DeviceShare, Messages, ModelSizes, bucketed_all_reduce, ring_bytes
from src.parallel.stage_cut import StageCut


class LayoutShares:
    """The planner's methods of `Mesh`, from its settings and what `check_model` found: where
    the pipeline's stages 1.. start, what tensor parallel splits."""

    cfg: MeshConfig
    device_type: str
    precision: str
    layout: Layout
    runs_ddp: bool  # dp_replicate alone: torch's DDP
    shards: bool  # FSDP2 shards the model over dp_shard (set, even of one rank)
    stage_cut: StageCut | None
    stage_points: tuple[int, ...] = ()
    split: TPSplit | None = None

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
        """Under DDP, rank 0's replica (its stages under the stage cut) on its share of the
        batch, with the reducer's buckets. Else one share per pp rank (the first of its tp and
        data-parallel peers, which hold as much): its stages' blocks on its data-parallel share
        of the batch, in micro-batches (all kept for backward, as GPipe does: 1F1B keeps
        fewer), its state split by tp and then by dp_shard, plus what FSDP holds while the
        model runs (`fsdp_working_set`)."""
        layout, count = self.layout, len(sizes.block_parameter_bytes)
        if self.runs_ddp:
            return self.replica_shares(sizes, micro_batch // layout.dp)
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

    def replica_shares(self, sizes: ModelSizes, samples: int) -> list[DeviceShare]:
        """A DDP replica fed `samples` per micro-step: the whole model, or its stages under the
        stage cut, each with the reducer's buckets (`ddp.bucket_bytes`)."""
        if self.stage_cut is not None:
            buckets = not self.cfg.gradient_as_bucket_view
            return self.stage_cut.device_shares(self.device_type, sizes, samples, buckets)
        buckets = bucket_bytes(self.cfg, sizes.parameter_bytes)
        return [DeviceShare(f"{self.device_type}:0", samples, extra_bytes={"gradients": buckets})]

    def fsdp_working_set(self, sizes: ModelSizes, blocks: list[int]) -> dict[str, int]:
        """What FSDP adds while the model runs to a rank holding `blocks`: under pp all of its
        stages gathered (they stay so through the schedule's run: `wrap`), else
        `fsdp.working_set` of its units as a tp rank keeps them; nothing unless FSDP shards.
        Gathered in the autocast dtype under bf16/fp16 (`fsdp.mixed_precision`)."""
        if not self.shards:
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
        if not self.shards or self.layout.pp > 1:
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
        if self.runs_ddp:
            stages = (
                self.stage_cut.step_traffic(sizes, samples, accumulate) if self.stage_cut else {}
            )
            return {**stages, **ddp_traffic(sizes, layout.dp)}
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
        if self.shards:
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
        `step_traffic` counts their bytes); DDP's: its bucketed all-reduce, once per step
        (no_sync skips the others; the stage cut's copies stay in the process)."""
        layout, samples = self.layout, micro_batch // self.layout.dp
        if self.runs_ddp:
            return [bucketed_all_reduce(sizes.parameter_bytes, layout.dp)]
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
        if self.shards:
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
        if self.stage_cut is not None:
            return self.stage_cut.idle_fraction()
        if self.layout.pp == 1:
            return 0.0
        return schedule_bubble(self.layout.pp, self.cfg.stages_per_rank, self.cfg.microbatches)
