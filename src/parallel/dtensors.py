"""Figures of a model whose tensors may be DTensors (split by tp, sharded by FSDP, on the meta
device under pp): the bytes this process holds, and its gradients' norm taken whole, as
single's."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication


def held_bytes(model: nn.Module) -> int:
    """The bytes of `model`'s parameters and buffers in this process's memory: its local shards
    of DTensors, nothing of a tensor on the meta device."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.nbytes for t in local if not t.is_meta)


def squared_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """The squared 2-norm of `parameters`' gradients, whole (a collective for DTensors)."""
    gradients = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(gradients)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).square()


def by_mesh(parameters: list[nn.Parameter]) -> dict[Any, list[nn.Parameter]]:
    """`parameters` by the mesh of their DTensors (None: plain tensors)."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for parameter in parameters:
        mesh = parameter.device_mesh if isinstance(parameter, DTensor) else None
        groups.setdefault(mesh, []).append(parameter)
    return groups


def clip_by_whole_norm(
    groups: dict[Any, list[nn.Parameter]],
    max_norm: float,
    uncounted: set[int],
    group: dist.ProcessGroup | None,
) -> None:
    """Clip every group's gradients by the norm of them all (each group's norm taken alone,
    which torch cannot stack across meshes), leaving out the parameters in `uncounted` (by id:
    a tied tensor's copies) and summed over the ranks of `group` (pp's, each holding its own
    stages')."""
    squared = sum(
        squared_norm([p for p in params if id(p) not in uncounted]) for params in groups.values()
    )
    if group is not None:
        dist.all_reduce(squared, group=group)
    with implicit_replication():  # the norm, a plain tensor, scales DTensor gradients too
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, squared.sqrt())
