"""A step's work as the predicted step time prices it (`step_time.py`), counted by running the
step under `WorkCounter`: its aten ops, the FLOPs of the ops torch's flop counter knows
(matmuls, convolutions, attention) by the size of each call, since a small matmul runs far
below a large one's rate, and the bytes the other ops read and write, since an optimizer's
and the activations' elementwise ops are bound by memory, not by FLOPs."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry


def size_class(flops: float) -> int:
    """The class of a call of `flops` FLOPs: log2 of them, rounded."""
    return round(math.log2(max(flops, 1)))


class WorkCounter(TorchDispatchMode):
    """Counts the aten ops run under it (forward, backward and optimizer alike), the FLOPs of
    each call `flop_registry` knows by its `size_class`, and the bytes of the tensors each
    other op that makes a tensor reads and writes (views and metadata move none)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.flops_by_size: dict[int, float] = {}
        self.moved_bytes = 0

    @property
    def flops(self) -> float:
        return sum(self.flops_by_size.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        if func._overloadpacket in flop_registry:
            flops = flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
            if flops:
                size = size_class(flops)
                self.flops_by_size[size] = self.flops_by_size.get(size, 0) + flops
        elif not func.is_view and tensor_bytes(out):
            self.moved_bytes += tensor_bytes((args, kwargs)) + tensor_bytes(out)
        return out


def tensor_bytes(tree: Any) -> int:
    return sum(
        leaf.numel() * leaf.element_size()
        for leaf in tree_leaves(tree)
        if isinstance(leaf, torch.Tensor)
    )
