"""Pipeline parallel over processes with torch.distributed.pipelining: the stages each rank holds,
the schedules by name and their up-front checks, and `apply_pp`.

The model is cut into pp x stages_per_rank stages at its blocks (`pipeline_cut.cut_model`,
balanced by parameter count: an nn.Sequential between its children, any other model by torch's
tracer). A rank holds stages
r, r + pp, ... (the looped schedules), or r and 2 pp - 1 - r (the V of ZBVZeroBubble and
DualPipeV, whose first and last stages are both on rank 0). The schedules run each micro-batch's
forward and backward themselves; the losses they see are the task's sums, so their gradients are
of the summed loss (scale_grads=False: the default would divide them by the micro-batch count).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FULL_BACKWARD,
    _Action,
    _PipelineContext,
    _PipelineSchedule,
    get_schedule_class,
)

from src.components.averaged_weights import local
from src.components.batches import Tree, batch_size, meta_resized
from src.config.base import ConfigError
from src.parallel.pipeline_cut import META, Tie, cut_model, place
from src.parallel.shares import Messages, ModelSizes
from src.parallel.stages.costs import boundary_bytes
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


def stage_ranks(schedule: str, pp: int, stages_per_rank: int) -> list[int]:
    """The pp rank holding each stage."""
    if schedule in V_SHAPED:
        return [*range(pp), *reversed(range(pp))]
    return [stage % pp for stage in range(pp * stages_per_rank)]


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


@dataclass(frozen=True)
class RankStages:
    """This pp rank's part of a model cut into stages (`cut_model`)."""

    parts: dict[int, nn.Module]  # its stages' modules, by stage index
    # The pp rank that saves each parameter and buffer name (the first holding it), and the
    # names this rank holds: those its stages use (a tied tensor under the names they use).
    owner: dict[str, int]
    held: frozenset[str]
    ranks: list[int]  # the pp rank holding each stage
    # Its stages' modules for batches shaped like the (meta) one given: `parts` again, unless
    # the stages were traced (each shape its own).
    reshaped: Callable[[Tree], dict[int, nn.Module]]
    # The tensors used on more than one stage: the pp ranks holding each, its home (the first
    # stage's) first.
    ties: list[tuple[Tie, list[int]]]


def holders(ranks: list[int], stages: Sequence[int]) -> list[int]:
    """The pp ranks holding `stages` (`ranks`: each stage's), in the stages' order, once each."""
    return list(dict.fromkeys(ranks[stage] for stage in stages))


def stage_parts(
    model: nn.Module,
    mesh: DeviceMesh,
    schedule: str,
    stages_per_rank: int,
    example: Tree,
    device: torch.device,
) -> RankStages:
    """This rank's stages of `model` (`cut_model`: sharing the model's tensors, not copies of
    them) for micro-batches like `example` (meta); its tensors go to `device`, the others' to the
    meta device. A tensor tied across stages of several ranks goes to each under the names its
    stages use there (GPT's embedding weight on the first stage's rank, its head's on the last's),
    a copy apiece, untied from the names left on the meta device (`TiedCopy`)."""
    pp, pp_rank = mesh.size(), mesh.get_local_rank()
    cut = cut_model(model, pp * stages_per_rank, example, device)
    ranks = stage_ranks(schedule, pp, stages_per_rank)
    owner = {name: ranks[stages[0]] for name, stages in cut.uses.items()}
    held = frozenset(name for name, uses in cut.uses.items() if pp_rank in holders(ranks, uses))
    place(model, lambda name: device if name in held else META)
    ties = [(tie, holders(ranks, tie.stages)) for tie in cut.ties]

    def mine(batch: Tree) -> dict[int, nn.Module]:
        return {s: module for s, module in enumerate(cut.modules(batch)) if ranks[s] == pp_rank}

    return RankStages(mine(example), owner, held, ranks, mine, ties)


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of a parameter that stages on other ranks use too (a tied embedding and
    head, held by the first stage's rank and the last's, as in Megatron-LM)."""

    parameter: nn.Parameter
    group: dist.ProcessGroup  # the ranks holding a copy, of this rank's pp group
    home: bool  # the first stage's copy: the one the gradients' norm counts


def tied_copies(model: nn.Module, stages: RankStages, mesh: DeviceMesh) -> list[TiedCopy]:
    """This rank's copies of the parameters in `stages.ties` (`model`'s, wrapped as they are
    now), each with the group of the ranks holding one in its pp group. A collective of every
    process of `mesh` (the whole job's, with a `pp` dimension): each makes every pp group's."""
    pp = mesh.mesh_dim_names.index("pp")
    pp_groups = mesh.mesh.movedim(pp, -1).reshape(-1, mesh.size(pp))
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    pp_rank = mesh.get_local_rank("pp")
    copies = []
    for tie, ranks in stages.ties:
        if len(ranks) == 1 or tie.names[0] not in parameters:  # one copy; a buffer
            continue
        group, _ = dist.new_subgroups_by_enumeration([row[ranks].tolist() for row in pp_groups])
        if pp_rank in ranks:
            name = next(name for name in tie.names if name in stages.held)
            copies.append(TiedCopy(model.get_parameter(name), group, pp_rank == ranks[0]))
    return copies


def sum_tied_gradients(copies: list[TiedCopy], before: dict[int, torch.Tensor | None]) -> None:
    """Each tied copy's gradient gained since `before` (by parameter id) summed over the ranks
    holding a copy: each then has single's, the sum over every use of the one tensor. Copies
    sharded alike (FSDP over the same data-parallel mesh) sum shard by shard."""
    for copy in copies:
        gradient, old = local(copy.parameter.grad), before[id(copy.parameter)]
        gained = gradient if old is None else gradient - local(old)
        dist.all_reduce(gained, group=copy.group)
        if old is not None:
            gradient.copy_(local(old) + gained)


def apply_pp(
    parts: dict[int, nn.Module],
    mesh: DeviceMesh,
    device: torch.device,
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[_PipelineSchedule, list[PipelineStage]]:
    """This rank's stages (`stage_parts`, perhaps tp-split or sharded since) in the named
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


class ScaleGradients(torch.autograd.Function):
    """The loop's `sums.backward(gradient)` for a micro-step the schedule has already run
    backward: it scales that micro-step's gradients (of the summed loss) by gradient[0], the
    loop's 1 / divisor (times a GradScaler's scale), through `rescale`."""

    @staticmethod
    def forward(ctx, sums: torch.Tensor, rescale: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.rescale = rescale
        return sums.clone()

    @staticmethod
    def backward(ctx, gradient: torch.Tensor) -> tuple[None, None]:
        ctx.rescale(gradient[0])
        return None, None


def rescale_since(
    parameters: list[nn.Parameter], before: list[torch.Tensor | None], factor: torch.Tensor
) -> None:
    """Scale what each gradient gained since `before` (earlier micro-steps' part stays)."""
    for parameter, old in zip(parameters, before, strict=True):
        if parameter.grad is None:
            continue
        if old is None:
            parameter.grad.mul_(factor)
        else:
            parameter.grad.sub_(old).mul_(factor).add_(old)


class PipelineRun:
    """This rank's part of a pipeline, run a micro-step at a time for the loop's `apply`: the
    first stage's rank feeds the inputs, the last stage's the targets; the task's sums, known
    on the last, are broadcast to every pp rank (the main process, rank 0, logs them)."""

    def __init__(
        self,
        cfg,
        mesh: DeviceMesh,
        device: torch.device,
        stages: RankStages,
        tied: list[TiedCopy],
    ):
        self.group, self.rank, self.device = mesh.get_group(), mesh.get_local_rank(), device
        self.mesh, self.stages, self.owner, self.tied = mesh, stages, stages.owner, tied
        # The copies the gradients' norm leaves out: another rank counts the tensor.
        self.uncounted = {id(copy.parameter) for copy in tied if not copy.home}
        parts = stages.parts
        self.clock = StageClock(device)
        self.schedule, pipeline_stages = apply_pp(
            parts, mesh, device, cfg.schedule, cfg.microbatches, self.clock.timed(self.loss)
        )
        self.clock.time_stages(pipeline_stages)
        self.first, self.last = stages.ranks[0], stages.ranks[-1]  # the first and last stages'
        # Once each: a tied tensor two stages of this rank use (the V's first and last) too.
        self.parameters = list(
            {id(p): p for part in parts.values() for p in part.parameters()}.values()
        )
        self.microbatches = cfg.microbatches
        self.fn: Callable | None = None
        self.captured: list[torch.Tensor] = []
        self.sums_shape: tuple | None = None
        self.evaluations: dict[int, _PipelineSchedule] = {}
        # Evaluation's forward-only schedule, of the same stage placement: the V's under
        # ZBVZeroBubble (DualPipeV takes no fewer micro-batches than stages; evaluation runs one).
        v_shaped = "ZBVZeroBubble" if cfg.schedule in V_SHAPED else "LoopedBFS"
        self.evaluation_kind = "GPipe" if len(parts) == 1 else v_shaped

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch: the summed loss; all the sums are kept."""
        sums = self.fn(outputs, targets)
        self.captured.append(sums.detach())
        return sums[0].clone()  # not a view: the split backward detaches the loss in place

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, fn: Callable) -> torch.Tensor:
        self.fn, self.captured = fn, []
        args = (inputs,) if self.rank == self.first else ()
        target = targets if self.rank == self.last else None
        if not torch.is_grad_enabled():
            self.evaluation(inputs).eval(*args, target=target)
            return self.broadcast_sums(1)
        before = [None if p.grad is None else p.grad.clone() for p in self.parameters]
        with self.clock.step():
            self.schedule.step(*args, target=target)
        previous = {id(p): old for p, old in zip(self.parameters, before, strict=True)}
        sum_tied_gradients(self.tied, previous)
        sums = self.broadcast_sums(self.microbatches).requires_grad_()
        return ScaleGradients.apply(
            sums, lambda factor: rescale_since(self.parameters, before, factor)
        )

    def evaluation(self, inputs: Tree) -> _PipelineSchedule:
        """A schedule for evaluating batches like `inputs`, whole (one micro-batch: no split to
        divide, and no gradients to keep): torch's stages keep the shapes they first ran, so
        each batch size (an evaluation's last, smaller batch) gets stages of its own (traced
        stages, traced for it: `RankStages.reshaped`)."""
        samples = batch_size(inputs)
        if samples not in self.evaluations:
            kind = self.evaluation_kind
            parts = self.stages.reshaped(meta_resized(inputs, samples))
            schedule, _ = apply_pp(parts, self.mesh, self.device, kind, 1, self.loss)
            if kind in V_SHAPED:
                # torch 2.14.1's eval() of a V schedule still runs its backward actions, and the
                # one between a rank's two adjacent stages asserts a backward ("can't
                # steal_bwd_input if this stage doesn't have backward"): they are skipped.
                for action in (FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
                    schedule.register_custom_function(action, skip_backward)
            self.evaluations[samples] = schedule
        return self.evaluations[samples]

    def broadcast_sums(self, microbatches: int) -> torch.Tensor:
        # The last M: on its first step a schedule may also call the loss on its shape pass.
        last_m = self.captured[-microbatches:]
        sums = torch.stack(last_m).sum(0) if self.rank == self.last else None
        if self.sums_shape is None:
            box = [(len(sums), sums.dtype) if sums is not None else None]
            dist.broadcast_object_list(box, group=self.group, group_src=self.last)
            self.sums_shape = box[0]
        if sums is None:
            length, dtype = self.sums_shape
            sums = torch.zeros(length, dtype=dtype, device=self.device)
        dist.broadcast(sums, group=self.group, group_src=self.last)
        return sums

    def gathered(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state_dict with each tensor from the rank that trains it (the others hold it on
        the meta device: its shapes, into which they receive); a tied tensor's names one tensor
        again, as single's (saved once)."""
        alias = {name: tie.names[0] for tie, _ in self.stages.ties for name in tie.names[1:]}
        for name, value in state.items():
            if name in alias:
                continue
            owner = self.owner[name]
            if owner == self.rank:
                on_device = value.to(self.device)
            else:
                on_device = torch.empty(value.shape, dtype=value.dtype, device=self.device)
            dist.broadcast(on_device, group=self.group, group_src=owner)
            state[name] = on_device.cpu()
        for name, first in alias.items():
            if name in state:
                state[name] = state[first]
        return state

    def merged(self, state: dict[str, Any]) -> dict[str, Any]:
        """Every rank's optimizer state dict (each holds its stages' parameters), by single's
        parameter index, as one: per-parameter states and each group's parameters together."""
        every = self.every_rank(state)
        groups = [
            {
                **group,
                # A tied parameter's state comes from each rank holding a copy: alike, once.
                "params": sorted({i for part in every for i in part["param_groups"][g]["params"]}),
            }
            for g, group in enumerate(state["param_groups"])
        ]
        entries = {index: entries for part in every for index, entries in part["state"].items()}
        return {"state": dict(sorted(entries.items())), "param_groups": groups}

    def idle_fractions(self) -> list[float | None]:
        """Each pp rank's measured idle fraction (`StageClock`), in pp rank order: a collective
        of the pp ranks."""
        return self.every_rank(self.clock.idle_fraction())

    def every_rank(self, value: Any) -> list:
        """Each pp rank's `value`, in pp rank order: a collective of the pp ranks."""
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, value, group=self.group)
        return every


def skip_backward(action: _Action, ctx: _PipelineContext) -> None:
    """A backward action of a forward-only run: nothing to compute; its gradient's receive,
    posted empty (no backward), is taken off as the action itself would."""
    ctx.schedule_ref.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None)


class StageClock:
    """How long this rank computes in each training micro-step's `schedule.step`: its stages'
    forward and backward chunks and the loss (timed where the schedule calls them), against the
    step's wall time. The rest of the step the rank waited for its peers' activations or
    gradients (the bubble) or sent its own; the idle fraction is that rest's share, over every
    step but the first (which also infers the stages' shapes). On CUDA every reading waits for
    the device's queued work."""

    def __init__(self, device: torch.device):
        self.device = device
        self.computing_s = 0.0  # in the timed calls, so far
        self.steps: list[tuple[float, float]] = []  # (wall, computing) seconds of each step

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def timed(self, work: Callable) -> Callable:
        @functools.wraps(work)
        def timed_work(*args: Any, **kwargs: Any) -> Any:
            started = self.now()
            try:
                return work(*args, **kwargs)
            finally:
                self.computing_s += self.now() - started

        return timed_work

    def time_stages(self, stages: list[PipelineStage]) -> None:
        """Time each stage's chunks (those of the split backward too) where the schedule calls
        them."""
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self.timed(getattr(stage, name)))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        started, computed = self.now(), self.computing_s
        yield
        self.steps.append((self.now() - started, self.computing_s - computed))

    def idle_fraction(self) -> float | None:
        """None before two steps have run."""
        timed = self.steps[1:]
        if not timed:
            return None
        wall = sum(step_s for step_s, _ in timed)
        return 1 - sum(computing_s for _, computing_s in timed) / wall
