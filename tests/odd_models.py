"""Models at the edges of what the template takes, for tests only, each breaking an assumption the
shipped models keep: picked with `model._target_=tests.odd_models.<Name>` and sized like the MLP
(`model.hidden`, `model.depth`) or the Transformer."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from src.components.models import MLP, Transformer

log = logging.getLogger(__name__)


def unpack(value: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden, skip) from a tensor, a {"hidden", "skip"} dict, or a [hidden, skip] tuple/list."""
    if torch.is_tensor(value):
        return value, None
    if isinstance(value, dict):
        return value["hidden"], value["skip"]
    return value[0], value[1]


class StructuredBlock(nn.Module):
    """Linear + ReLU on the hidden activation; passes (hidden, skip) on as a tuple, a dict or a
    list (`packing`). The first block's output is the skip that every later block carries on."""

    def __init__(self, width_in: int, width_out: int, packing: str):
        super().__init__()
        self.layer = nn.Sequential(nn.Flatten(), nn.Linear(width_in, width_out), nn.ReLU())
        self.packing = packing

    def forward(self, value: Any) -> Any:
        hidden, skip = unpack(value)
        hidden = self.layer(hidden)
        skip = hidden if skip is None else skip
        if self.packing == "dict":
            return {"hidden": hidden, "skip": skip}
        return (hidden, skip) if self.packing == "tuple" else [hidden, skip]


class StructuredHead(nn.Linear):
    def forward(self, value: Any) -> torch.Tensor:
        hidden, skip = unpack(value)
        return super().forward(hidden + skip)


class StructuredMLP(nn.Sequential):
    """An MLP whose blocks hand on tuples, dicts and lists of tensors (in turn) instead of one
    tensor: every stage boundary of a pipeline carries a structure."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int, depth: int):
        widths = [math.prod(input_shape)] + [hidden] * depth
        packings = ("tuple", "dict", "list")
        blocks = [
            StructuredBlock(a, b, packings[i % 3])
            for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True))
        ]
        super().__init__(*blocks, StructuredHead(hidden, num_classes))


class ScaledBlock(nn.Module):
    """Linear + ReLU that returns (activation, 1.0): a Python float no device can hold."""

    def __init__(self, width: int):
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(width, width), nn.ReLU())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        return self.layer(x), 1.0


class Unscale(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, value: tuple[torch.Tensor, float]) -> torch.Tensor:
        hidden, scale = value
        return self.block(hidden * scale)


class FloatBoundaryMLP(nn.Sequential):
    """The MLP with block 1 returning (tensor, float): no stage may start at block 2."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int, depth: int):
        blocks = list(MLP(input_shape, num_classes, hidden, depth))
        blocks[1] = ScaledBlock(hidden)
        blocks[2] = Unscale(blocks[2])
        super().__init__(*blocks)


class DictOutputMLP(MLP):
    """The MLP with its logits in a dict, which the loss cannot take."""

    def forward(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": super().forward(inputs)}


class JoinedInputs(nn.Module):
    """A dict of (batch, ...) inputs, flattened and concatenated in key order: (batch, features)."""

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([inputs[key].flatten(1) for key in sorted(inputs)], dim=1)


class LogitsAndValue(nn.Module):
    """Two heads: {"logits": (batch, classes), "value": (batch,)}."""

    def __init__(self, width: int, num_classes: int):
        super().__init__()
        self.logits = nn.Linear(width, num_classes)
        self.value = nn.Linear(width, 1)

    def forward(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.logits(hidden), "value": self.value(hidden)[:, 0]}


class DictInDictOutMLP(MLP):
    """The MLP fed a dict of inputs (`tests.odd_data.halves_and_values`' {"left", "right"}) and
    returning a dict, {"logits", "value"}, which `tests.odd_tasks.LabelAndValue` scores."""

    def __init__(self, **sizes: Any):
        super().__init__(**sizes)
        self[0][0] = JoinedInputs()  # in place of the Flatten
        self[-1] = LogitsAndValue(sizes["hidden"], sizes["num_classes"])


class ListOutputMLP(MLP):
    def forward(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        return [super().forward(inputs)]


class FrozenMLP(MLP):
    """The MLP with every parameter frozen: nothing to train."""

    def __init__(self, **sizes: Any):
        super().__init__(**sizes)
        self.requires_grad_(False)


class LazyMLP(MLP):
    """The MLP with its first layer a LazyLinear: its input width is found by the first forward."""

    def __init__(self, **sizes: Any):
        super().__init__(**sizes)
        first = self[0][1]
        self[0][1] = nn.LazyLinear(first.out_features)


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


class UnusedParameterMLP(MLP):
    """The MLP with a layer its forward pass never uses: a parameter that gets no gradient, which
    DDP waits for unless `parallel.find_unused_parameters=true`."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        self[0].append(UnusedBranch(sizes["hidden"]))


class UnusedBranch(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.unused = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ThreadNotingMLP(MLP):
    """The MLP, logging the thread of each training forward pass on data (`training forward in
    <thread name>`; not the start-up's checks on the meta device): under dp, one line per
    replica."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.training and not inputs.is_meta:
            log.info("training forward in %s", threading.current_thread().name)
        return super().forward(inputs)


class PacedMLP(MLP):
    """The MLP, whose training steps take at least STEP_S each (it waits, using no CPU) in the
    first run of a SLURM job: a run of known length, for tests that need a run still training
    when a signal comes at a time the test does not choose (SLURM's before a time limit). Once
    SLURM has requeued the job (SLURM_RESTART_COUNT set), the rest trains at full speed. It trains
    the MLP's weights."""

    STEP_S = 0.1

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.training and "SLURM_RESTART_COUNT" not in os.environ:
            time.sleep(self.STEP_S)
        return super().forward(inputs)


class LoopMLP(nn.Module):
    """The shape of most research code: not an `nn.Sequential`; `forward` loops over a
    `ModuleList` of blocks between a stem and a head."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, width: int, layers: int):
        super().__init__()
        self.stem = nn.Linear(math.prod(input_shape), width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.stem(inputs.flatten(1))
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return self.head(hidden)


class LongSkipLoopMLP(LoopMLP):
    """LoopMLP whose head also takes the stem's output (a U-Net's long skip): in three pipeline
    stages a value that passes over the middle one, which torch's stages cannot hand on."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        stem = self.stem(inputs.flatten(1))
        hidden = stem
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return self.head(hidden + stem)


class SparseEmbeddingMLP(nn.Sequential):
    """Token ids through an `nn.Embedding(sparse=True)` (word2vec's, a recommender's) and
    Linear+ReLU blocks to per-token logits: its embedding's gradient is a sparse tensor, which
    has no storage."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int, depth: int):
        blocks = [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(depth - 1)]
        embedding = nn.Embedding(num_classes, hidden, sparse=True)
        super().__init__(embedding, *blocks, nn.Linear(hidden, num_classes))
