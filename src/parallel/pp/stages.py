"""The stages each pp rank holds of a model cut over processes (`cut.cut_model`): its own on its
device, the others' on the meta device, and the tensors tied across ranks' stages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from src.components.batches import Tree
from src.parallel.pp.cut import META, Tie, cut_model, place
from src.parallel.pp.schedules import stage_ranks


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
    a copy apiece, untied from the names left on the meta device (`tied.TiedCopy`)."""
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
