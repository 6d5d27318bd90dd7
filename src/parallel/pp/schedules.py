"""torch.distributed.pipelining's schedules by name: their up-front checks, the pp rank holding
each stage under each, and `apply_pp`, which puts a rank's stages in one.

A rank holds stages r, r + pp, ... (the looped schedules), or r and 2 pp - 1 - r (the V of
ZBVZeroBubble and DualPipeV, whose first and last stages are both on rank 0). The schedules run
each micro-batch's forward and backward themselves; the losses they see are the task's sums, so
their gradients are of the summed loss (scale_grads=False: the default would divide them by the
micro-batch count).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    _Action,
    _PipelineContext,
    _PipelineSchedule,
    get_schedule_class,
)

from src.config.base import ConfigError
from src.runtime.torch_private import pipeline_warmup_skips_own_rank

ONE_STAGE = ("GPipe", "1F1B")  # one stage per rank
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # two stages per rank, in a V
SCHEDULES = (*ONE_STAGE, *LOOPED, *V_SHAPED)
# Those that split each backward into an input-gradient and a later weight-gradient action.
SPLIT_BACKWARD = ("InterleavedZeroBubble", *V_SHAPED)


def check_schedule(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> None:
    """ConfigError, in one line, for a schedule that cannot run these settings (what torch would
    otherwise find only once every rank has started)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule={schedule} is none of {', '.join(SCHEDULES)}")
    stages = pp * stages_per_rank
    if schedule in ONE_STAGE and stages_per_rank != 1:
        raise ConfigError(
            f"parallel.schedule={schedule} runs one stage per rank; set parallel.stages_per_rank=1"
            f", or use {' or '.join(LOOPED)} for {stages_per_rank}"
        )
    if schedule in V_SHAPED and stages_per_rank != 2:
        raise ConfigError(
            f"parallel.schedule={schedule} runs 2 stages per rank in a V; set "
            "parallel.stages_per_rank=2"
        )
    if schedule in ("1F1B", "DualPipeV") and microbatches < stages:
        raise ConfigError(
            f"parallel.schedule={schedule} needs parallel.microbatches ({microbatches}) >= the "
            f"stages ({stages})"
        )
    rounds = max(1, microbatches // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and microbatches % rounds:
        raise ConfigError(
            f"parallel.schedule={schedule} needs parallel.microbatches ({microbatches}) to be a "
            f"multiple of its rounds (microbatches // pp = {rounds})"
        )


def stage_ranks(schedule: str, pp: int, stages_per_rank: int) -> list[int]:
    """The pp rank holding each stage."""
    if schedule in V_SHAPED:
        return [*range(pp), *reversed(range(pp))]
    return [stage % pp for stage in range(pp * stages_per_rank)]


def apply_pp(
    parts: dict[int, nn.Module],
    mesh: DeviceMesh,
    device: torch.device,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[_PipelineSchedule, list[PipelineStage]]:
    """This rank's stages (`stages.stage_parts`, perhaps tp-split or sharded since) in the named
    schedule; returns it and the stages."""
    stages = mesh.size() * len(parts)
    group = mesh.get_group()
    pipeline_warmup_skips_own_rank()
    pipeline_stages = [
        PipelineStage(part, s, stages, device, group=group) for s, part in parts.items()
    ]
    kind = get_schedule_class(schedule)
    runs = pipeline_stages[0] if schedule in ONE_STAGE else pipeline_stages
    return kind(runs, microbatches, loss_fn=loss_fn, scale_grads=False), pipeline_stages


def skip_backward(action: _Action, ctx: _PipelineContext) -> None:
    """A backward action of a forward-only run: nothing to compute; its gradient's receive,
    posted empty (no backward), is taken off as the action itself would."""
    ctx.schedule_ref.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None)
