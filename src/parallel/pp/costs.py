"""What pipeline parallel costs, for the planner: which blocks each rank holds, the share of a
step each rank waits (the bubble), and the activations and gradients sent across the stages'
boundaries (the in-process stage cut's too)."""

from __future__ import annotations

from collections.abc import Sequence

from src.parallel.pp.schedules import stage_ranks
from src.parallel.shares import Messages, ModelSizes


def schedule_bubble(pp: int, stages_per_rank: int, microbatches: int) -> float:
    """The share of a step each rank waits, forward and backward taken to cost the same on
    every stage and sends nothing. GPipe and 1F1B: (p - 1) / (m + p - 1), the GPipe paper's
    (Huang et al. 2019, arxiv.org/abs/1811.06965, section 2.3) and Megatron-LM's for 1F1B
    (Narayanan et al. 2021, arxiv.org/abs/2104.04473, section 2.2.1: bubble over ideal time
    (p - 1) / m). The looped schedules, v stages per rank, run v times as many chunks each 1/v
    as long behind the same ramp: (p - 1) / (v m + p - 1) (ibid., section 2.2.2: (1 / v)
    (p - 1) / m; LoopedBFS's breadth-first paper, arxiv.org/abs/2211.05953, which torch cites,
    has the same for m >= p). InterleavedZeroBubble, ZBVZeroBubble and DualPipeV (v = 2) fill
    part of it with the weight gradients they defer: for them this is an upper bound. For the V
    schedules: the zero-bubble paper (Qi et al. 2024, arxiv.org/abs/2401.10241, section 6) has
    ZB-V's bubble near zero where forward, input and weight gradients cost the same; DualPipe's
    README (github.com/deepseek-ai/DualPipe) gives DualPipeV (p - 1)(F&B + B - 3W) in chunk
    times against the looped (p - 1)(F + B), no more while a weight gradient W costs a third of
    a full backward B or more."""
    ramp = pp - 1
    return ramp / (stages_per_rank * microbatches + ramp)


def stage_traffic(
    points: tuple[int, ...], sizes: ModelSizes, samples: int, accumulate: int
) -> dict[str, int]:
    """What crosses the stages' boundaries (before blocks `points`) per step of `accumulate`
    micro-steps of `samples` samples: activations forward, gradients back."""
    return {"stage activations": accumulate * boundary_bytes(points, sizes, samples)}


def stage_messages(
    points: tuple[int, ...], sizes: ModelSizes, samples: int, runs: int, pp: int
) -> list[Messages]:
    """The busiest rank's sends in `runs` passes of `samples` samples: each boundary its stages
    touch, activations forward and gradients back."""
    boundaries = -(-2 * len(points) // pp)
    each = boundary_bytes(points, sizes, samples) // (2 * len(points))  # one way, one boundary
    return [Messages("send", 2 * runs * boundaries, each, 2, wrapper="pp")]


def boundary_bytes(split_points: Sequence[int], sizes: ModelSizes, samples: int) -> int:
    """Activations sent forward across every stage boundary and their gradients sent back."""
    return sum(2 * samples * sizes.block_output_bytes[point - 1] for point in split_points)


def stage_blocks(
    points: tuple[int, ...], blocks: int, schedule: str, pp: int, stages_per_rank: int
) -> list[list[tuple[int, int]]]:
    """Each of `pp` ranks' stages, as [start, end) ranges of the model's `blocks` blocks cut
    before `points`, as `schedule` places them."""
    bounds = [0, *points, blocks]
    owner = stage_ranks(schedule, pp, stages_per_rank)
    return [
        [(bounds[s], bounds[s + 1]) for s, held_by in enumerate(owner) if held_by == rank]
        for rank in range(pp)
    ]


def rank_blocks(stages: list[list[tuple[int, int]]]) -> list[list[int]]:
    """The blocks each rank holds, of its `stage_blocks`."""
    return [[b for start, end in ranges for b in range(start, end)] for ranges in stages]
