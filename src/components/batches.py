"""Batches as the data, the loop and the strategies carry them.

Inputs, targets and model outputs are each a tensor, or a tuple, list or dict of tensors (nested
too), every tensor holding the samples on dim 0. A model takes its inputs as one argument, as they
come (a dict arrives as a dict); a task takes the outputs and targets as the model and the data
give them. The functions below work leaf by leaf, so no code that carries a batch needs to know
its structure.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.data import default_collate

Tree = Any
"""A tensor, or a tuple, list or dict of them (nested too)."""


def tensors(batch: Tree) -> list[torch.Tensor]:
    """The tensors of `batch`, in a fixed order (dicts by insertion)."""
    return [leaf for leaf in tree_flatten(batch)[0] if torch.is_tensor(leaf)]


def batch_size(batch: Tree) -> int:
    """The number of samples: the length of the first tensor's dim 0."""
    first = next(iter(tensors(batch)), None)
    if first is None or first.dim() == 0:
        raise ValueError(f"a batch needs a tensor with a batch dimension, got {describe(batch)}")
    return len(first)


def collate(samples: list[Tree]) -> Tree:
    """Samples (each a structure of tensors, numbers or arrays) stacked into one batch of the
    same structure, leaf by leaf with torch's `default_collate` (which on its own turns tuples
    into lists, so that a batch from a DataLoader would differ from one of an in-memory set)."""
    _, spec = tree_flatten(samples[0])
    columns = zip(*(tree_flatten(sample)[0] for sample in samples), strict=True)
    return tree_unflatten([default_collate(list(column)) for column in columns], spec)


def concat(parts: list[Tree]) -> Tree:
    """Batches of one structure joined into one along dim 0, leaf by leaf."""
    _, spec = tree_flatten(parts[0])
    columns = zip(*(tree_flatten(part)[0] for part in parts), strict=True)
    return tree_unflatten([torch.cat(list(column)) for column in columns], spec)


def move(batch: Tree, device: torch.device) -> Tree:
    """`batch` on `device`. A copy to a GPU need not block the host: the GPU's stream runs it
    before the ops that use it. A copy to the host must have ended before the host reads it."""
    later = device.type != "cpu"
    if torch.is_tensor(batch):  # the common case, every step: tree_map costs ~8 us more
        return batch.to(device, non_blocking=later)
    return tree_map(lambda x: x.to(device, non_blocking=later) if torch.is_tensor(x) else x, batch)


def take(batch: Tree, index: Any) -> Tree:
    """The samples at `index` (an int, a slice or a tensor of indices) of every tensor."""
    return batch[index] if torch.is_tensor(batch) else tree_map(lambda x: x[index], batch)


def split(batch: Tree, parts: int) -> list[Tree]:
    """`parts` consecutive micro-batches (`Tensor.tensor_split`: sizes differ by at most one)."""
    leaves, spec = tree_flatten(batch)
    pieces = [leaf.tensor_split(parts) for leaf in leaves]
    return [tree_unflatten([piece[i] for piece in pieces], spec) for i in range(parts)]


def meta_resized(batch: Tree, size: int) -> Tree:
    """Tensors like `batch`'s with `size` samples, on the meta device: shapes, no memory."""
    return tree_map(lambda x: torch.empty(size, *x.shape[1:], dtype=x.dtype, device="meta"), batch)


def nbytes(batch: Tree) -> int:
    return sum(tensor.nbytes for tensor in tensors(batch))


def describe(value: Tree) -> str:
    """Shapes for messages: `[2, 10]`, or `{'logits': [2, 10], 'score': [2]}` for a dict."""
    shapes = tree_map(lambda x: list(x.shape) if torch.is_tensor(x) else type(x).__name__, value)
    return str(shapes)
