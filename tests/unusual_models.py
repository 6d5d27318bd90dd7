"""Models for tests only, each breaking an assumption the shipped models keep; picked with
`model._target_=tests.unusual_models.<Name>`."""

from __future__ import annotations

from torch import nn

from src.models import MLP


class BatchNormMLP(MLP):
    """The MLP with BatchNorm after its first layer: buffers (running statistics) that each rank
    updates from its own share of the batch."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        self[0].insert(2, nn.BatchNorm1d(sizes["hidden"]))
