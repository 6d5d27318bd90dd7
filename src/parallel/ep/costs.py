"""What the `ep` degree (expert parallel, `apply.py`) costs, for the planner (`mesh_shares.py`
prices an N-D layout with it): what ep splits of a model (`expert_split`), the experts' bytes
that FSDP gathers or copies beside them, and each MoE layer's token exchange (`all_to_all`) per
step: its buffers, traffic and messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from src.components.precision import AUTOCAST_DTYPES
from src.parallel.dp_shard.costs import gathered_bytes
from src.parallel.ep.apply import moe_layers
from src.parallel.layout import Layout
from src.parallel.shares import Messages


@dataclass(frozen=True)
class ExpertSplit:
    """What ep splits of a model, for the planner (`expert_split`)."""

    ep: int
    shards: int
    """The ranks that FSDP-shard each ep rank's experts: dp_shard / ep."""
    block_expert_bytes: list[int]
    """Each block's experts' parameter bytes (all of its experts)."""
    choices_per_sample: int
    """Expert choices a sample's tokens make in all of the model's MoE layers (seq x top_k
    each)."""
    width: int
    experts: int


def expert_split(model: nn.Sequential, inputs: torch.Tensor, layout: Layout) -> ExpertSplit:
    """`model`'s experts (on the meta device) and the choices a sample of `inputs` (token
    ids, (batch, seq)) makes, split by `layout`'s ep."""
    experts = [sum(p.nbytes for layer in moe_layers(block) for p in layer.experts.parameters())
               for block in model]  # fmt: skip
    layers = moe_layers(model)
    choices = inputs.shape[1] * sum(layer.top_k for layer in layers)
    router = layers[0].router
    shards = layout.dp_shard // layout.ep
    return ExpertSplit(layout.ep, shards, experts, choices, router.in_features, router.out_features)


def ep_gathered_bytes(split: ExpertSplit | None, blocks: list[int], held: int) -> int:
    """Of `held` bytes of `blocks` (before FSDP shards them), those that FSDP all-gathers: the
    dense parameters, and this ep rank's experts / ep unless it holds them alone (then FSDP
    copies them instead: `ep_copied_bytes`)."""
    if split is None:
        return held
    experts = sum(split.block_expert_bytes[b] for b in blocks)
    kept = 1 / split.ep if split.shards > 1 else 0
    return int(held - (1 - kept) * experts)


def ep_copied_bytes(split: ExpertSplit | None, precision: str) -> dict[str, int]:
    """What FSDP of one shard (ep = dp_shard) holds of the experts while a block runs: no
    all-gather, but its unsharded parameters still, the shard copied into them when the block
    runs and freed when it reshards (torch's `FSDPParamGroup.wait_for_unshard` at world size
    1), so one block's experts / ep at a time, never ahead of it."""
    if split is None or split.shards > 1:
        return {}
    return {"parameters": gathered_bytes(max(split.block_expert_bytes) // split.ep, precision)}


def ep_exchange_bytes(split: ExpertSplit, samples: int, precision: str) -> int:
    """One direction of one MoE layer's exchange, on average, in passes of `samples` samples:
    each choice's token (width, in the autocast dtype), all kept (capacity's drops send less)."""
    element = 2 if precision in AUTOCAST_DTYPES else 4
    layers = sum(1 for size in split.block_expert_bytes if size)
    return samples * split.choices_per_sample // layers * split.width * element


def ep_forward_buffers(split: ExpertSplit | None, samples: int, precision: str) -> dict[str, int]:
    """What the exchange adds while a rank's experts run forward alone (evaluation), on `samples`
    samples: its kept choices' tokens sent and its experts' received (`exchange`), one
    direction of a layer each, beside what the trace of `single`'s dispatch holds (its padded
    groups are as large as a rank's experts' at most: experts x capacity per sample). In
    training the peak is in backward, where neither is alive."""
    if split is None:
        return {}
    return {"activations": 2 * ep_exchange_bytes(split, samples, precision)}


def ep_traffic(split: ExpertSplit, samples: int, precision: str) -> dict[str, int]:
    """What a rank sends per step over ep, in passes of `samples` samples in all: every MoE
    layer's tokens to their experts and back (dispatch and combine), forward and backward,
    the (ep - 1) / ep of them whose experts are on another rank."""
    layers = sum(1 for size in split.block_expert_bytes if size)
    sent = layers * ep_exchange_bytes(split, samples, precision) * 2 * 2
    return {"token all-to-all": int(sent * (split.ep - 1) / split.ep)}


def ep_messages(split: ExpertSplit, samples: int, runs: int, precision: str) -> list[Messages]:
    """A rank's ep messages in `runs` passes of `samples` samples: per MoE layer, dispatch and
    combine forward and backward (each waited for), and the counts' exchange before them."""
    layers = sum(1 for size in split.block_expert_bytes if size)
    size = ep_exchange_bytes(split, samples, precision)
    counts = Messages("all_to_all", layers * runs, 8 * split.experts, split.ep)
    return [counts, Messages("all_to_all", 4 * layers * runs, size, split.ep)]
