"""A user's model that brings its own tensor-parallel styles, as a package outside src/ would:
its styles registered beside its class (`@tensor_parallel_styles`), picked with
`model._target_=tests.styled_models.ResidualFeedForward` and sized like the MLP."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from src.parallel.tp.registry import check_divides, tensor_parallel_styles


class FeedForward(nn.Module):
    """x + down(relu(up(x))), `up` widening by 2."""

    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class ResidualFeedForward(nn.Sequential):
    """A flattening input Linear, `depth` residual feed-forward blocks, a linear head."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int, depth: int):
        stem = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden))
        blocks = [FeedForward(hidden) for _ in range(depth)]
        super().__init__(stem, *blocks, nn.Linear(hidden, num_classes))


@tensor_parallel_styles(ResidualFeedForward)
def feed_forward_styles(
    model: nn.Module, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    """Each block's up colwise and down rowwise; the stem and the head replicated."""
    styles: dict[str, ParallelStyle] = {}
    for name, block in model.named_children():
        if isinstance(block, FeedForward):
            check_divides(block.up.out_features, f"block {name}'s inner features", tp)
            styles[f"{name}.up"], styles[f"{name}.down"] = ColwiseParallel(), RowwiseParallel()
    return styles
