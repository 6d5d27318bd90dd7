"""A block stack cut into stages on their own devices, run over micro-batches in GPipe order.

`Pipeline` wraps a model without copying it, so the parameters and state_dict keys stay those
of `single`: each stage of an `nn.Sequential` is a slice that shares the original blocks; any
other model's are torch's traced stages, bound to its tensors (`src/parallel/pp/cut.py`,
the cut parallel.pp makes too). Its forward
takes the targets and the loss function too, so that the loss is computed on the last stage
where the outputs are; `model_parallel` calls it directly and `hybrid` wraps it in DDP
(`device_ids=None`), which passes the arguments through.

The inputs and targets, and what a block hands to the next stage, may be a tensor or a tuple,
list or dict of tensors (nested too, `src/components/batches.py`): each is split into micro-batches
leaf by leaf, and each micro-batch's structure moves to the next stage's device as it is. Anything
else (a Python number, a string, ...) cannot be moved; `unmovable_boundaries` finds such block
boundaries with a forward pass on the meta device before any work, so that the strategy refuses
split points there and keeps the automatic split away from them (`cut.py`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from src.components.batches import Tree, batch_size, meta_resized, move, split
from src.parallel.base import LossFn
from src.parallel.pp.costs import schedule_bubble
from src.parallel.pp.cut import Cut, balanced_split_points, parameter_count

log = logging.getLogger(__name__)


def gpipe_ticks(stages: int, microbatches: int) -> Iterator[list[tuple[int, int]]]:
    """(stage, micro-batch) pairs per clock tick: at tick t, stage s runs micro-batch t - s.

    Within a tick the last stage comes first: its input copy is queued on the previous stage's
    device before that stage's next micro-batch, so on GPUs the copy does not wait behind it.
    """
    for tick in range(microbatches + stages - 1):
        yield [
            (stage, tick - stage)
            for stage in reversed(range(stages))
            if 0 <= tick - stage < microbatches
        ]


def movable(value: Any) -> bool:
    """Whether `value` can go to another device: a tensor, or tuples, lists and dicts of them."""
    leaves, _ = tree_flatten(value)
    return all(torch.is_tensor(leaf) for leaf in leaves)


def meta_block_outputs(model: nn.Sequential, inputs: Tree) -> list[Any] | None:
    """What each block of `model` (built on the meta device) returns for `inputs` (meta), or
    None when the blocks cannot run on the meta device (then nothing is known in advance)."""
    outputs, value = [], inputs
    try:
        with torch.no_grad():
            for block in model:
                value = block(value)
                outputs.append(value)
    except Exception:  # noqa: BLE001 - e.g. no meta kernel, or a block that reads the values
        log.debug("the blocks cannot run on the meta device", exc_info=True)
        return None
    return outputs


def describe_value(value: Any) -> str:
    """'a tuple holding a float', 'a str', ...: what a block hands on that cannot be moved."""
    leaves, _ = tree_flatten(value)
    odd = next(type(leaf).__name__ for leaf in leaves if not torch.is_tensor(leaf))
    if len(leaves) == 1 and leaves[0] is value:
        return f"a {odd}"
    return f"a {type(value).__name__} holding a {odd}"


def unmovable_boundaries(model: nn.Sequential, inputs: Tree) -> dict[int, Any]:
    """{block index: what the block before it returns} where that cannot be handed to another
    device, found by running `model` (built on the meta device) on `inputs` (meta); empty when
    the blocks cannot run there."""
    outputs = meta_block_outputs(model, inputs) or []
    return {i + 1: value for i, value in enumerate(outputs[:-1]) if not movable(value)}


class Pipeline(nn.Module):
    """`model` cut at `split_points` (balanced by parameter count when None), stage i on
    `devices[i]`; forward returns the sum of `fn` over `microbatches` micro-batches. An
    nn.Sequential is cut here, into slices of its own blocks; any other model comes with its
    `cut` (`pp.cut.cut_at`: stages traced by torch for each micro-batch shape, sharing the
    model's tensors, which are on their stages' devices already)."""

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[torch.device],
        microbatches: int,
        split_points: Sequence[int] | None = None,
        cut: Cut | None = None,
    ):
        super().__init__()
        self.model = model
        self.devices = list(devices)
        self.microbatches = microbatches
        self.cut = cut
        if cut is not None:
            self.split_points = cut.points
            parameters = dict(model.named_parameters())
            self.stage_parameters = [
                sum(p.numel() for name, p in parameters.items() if cut.stage_of[name] == stage)
                for stage in range(len(self.devices))
            ]
            return
        if split_points is None:  # every block boundary taken to be cuttable
            split_points = balanced_split_points([parameter_count(b) for b in model], len(devices))
        # The strategy has checked its settings (`stages/cut.py`); this guards the module's use.
        bounds = [0, *(split_points or []), len(model)]
        if len(bounds) != len(devices) + 1 or any(b <= a for a, b in itertools.pairwise(bounds)):
            raise ValueError(
                f"{len(model)} blocks cannot be cut into {len(devices)} stages at {split_points}"
            )
        self.split_points = list(split_points)
        blocks = list(model)
        # A plain list, not registered: the blocks are registered once, through `self.model`.
        self.stages = [nn.Sequential(*blocks[a:b]) for a, b in itertools.pairwise(bounds)]
        # Moved last to first: a parameter tied across stages ends on the first using it.
        for stage, device in reversed(list(zip(self.stages, self.devices, strict=True))):
            stage.to(device)
        self.stage_parameters = [parameter_count(stage) for stage in self.stages]

    def stage_modules(self, micro_batch: Tree) -> list[nn.Module]:
        """The stages' modules for `micro_batch`: traced ones are traced for its shape."""
        if self.cut is None:
            return self.stages
        return self.cut.modules(meta_resized(micro_batch, batch_size(micro_batch)))

    def run_stage(self, module: nn.Module, stage: int, value: Tree) -> Tree:
        """`module` (stage `stage`) on `value`: a traced stage after the first takes the values
        the stage before returned (a tuple of them) as its arguments. A parameter tied to an
        earlier stage's (GPT's head, its embedding's weight) lives on that stage's device; on
        another device the stage runs on a copy made here, whose gradient autograd adds into the
        parameter's, as single's two uses add theirs."""
        args = (value,)
        if self.cut is not None and stage > 0 and isinstance(value, tuple):
            args = value
        device = self.devices[stage]
        away = {
            name: parameter.to(device)
            for name, parameter in module.named_parameters(remove_duplicate=False)
            if parameter.device != device
        }
        if away:
            return torch.func.functional_call(module, away, args)
        return module(*args)

    def forward(self, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        # Uneven micro-batches are exact: `fn` returns sums. An eval batch smaller than M gets
        # fewer micro-batches rather than empty ones.
        chunks = min(self.microbatches, batch_size(inputs))
        activations = split(move(inputs, self.devices[0]), chunks)
        micro_targets = split(move(targets, self.devices[-1]), chunks)
        modules = [self.stage_modules(micro_batch) for micro_batch in activations]
        total = None
        last = len(self.devices) - 1
        for tick in gpipe_ticks(len(self.devices), chunks):
            for stage, micro in tick:
                x = move(activations[micro], self.devices[stage])
                activations[micro] = self.run_stage(modules[micro][stage], stage, x)
                if stage == last:
                    part = fn(activations[micro], micro_targets[micro])
                    total = part if total is None else total + part
        return total

    def describe(self) -> dict[str, Any]:
        """The layout and schedule, for the log and summary.json."""
        return {
            "stages": len(self.devices),
            "split_points": self.split_points,
            "stage_parameters": self.stage_parameters,
            "stage_devices": [str(d) for d in self.devices],
            "microbatches": self.microbatches,
            "bubble_fraction": schedule_bubble(len(self.devices), 1, self.microbatches),
        }


def log_layout(layout: dict[str, Any]) -> None:
    log.info(
        "pipeline: %d stages on %s, split before blocks %s, parameters per stage %s; "
        "%d micro-batch(es), bubble (idle) fraction %.1f%%",
        layout["stages"],
        ", ".join(layout["stage_devices"]),
        layout["split_points"],
        layout["stage_parameters"],
        layout["microbatches"],
        100 * layout["bubble_fraction"],
    )
