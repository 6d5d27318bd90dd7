"""A pp rank's part of a pipeline run a micro-step at a time in the loop every strategy shares
(`PipelineRun`): its stages (`stages.stage_parts`) in the configured schedule, the summed loss
broadcast to every pp rank, the gradients scaled as the loop asks, and the state gathered from
the ranks that train it for checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FULL_BACKWARD,
    _PipelineSchedule,
)

from src.components.batches import Tree, batch_size, meta_resized
from src.parallel.pp.clock import StageClock
from src.parallel.pp.schedules import V_SHAPED, apply_pp, skip_backward
from src.parallel.pp.stages import RankStages
from src.parallel.pp.tied import TiedCopy, sum_tied_gradients


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
