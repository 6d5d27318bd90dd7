"""Models for tests only, each breaking an assumption the shipped models keep; picked with
`model._target_=tests.unusual_models.<Name>`."""

from __future__ import annotations

import os

import torch
from torch import nn

from src.models import MLP, Transformer


class BatchNormMLP(MLP):
    """The MLP with BatchNorm after its first layer: buffers (running statistics) that each rank
    updates from its own share of the batch."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        self[0].insert(2, nn.BatchNorm1d(sizes["hidden"]))


class RankSeededMLP(MLP):
    """The MLP with a first layer drawn from a generator seeded by the process's rank: an
    initialisation that does not come only from the seeded torch RNG, so ranks differ unless
    the strategy starts them all from rank 0's weights (`single` is rank 0)."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        generator = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
        with torch.no_grad():
            layer = self[0][1]
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) / 8)


class TiedTransformer(Transformer):
    """The Transformer with its output layer tied to the token embedding: a parameter shared by
    the first block and the last."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        self[-1][1].weight = self[0].token.weight
