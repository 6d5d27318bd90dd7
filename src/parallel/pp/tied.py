"""Weights tied across stages on several pp ranks (a tied embedding and head, as GPT-2's): each
rank holding a stage that uses one trains a copy of its own, and after each micro-step the
copies' gradients are summed over those ranks, as Megatron-LM does for its first and last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from src.components.averaged_weights import local
from src.parallel.pp.stages import RankStages


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
