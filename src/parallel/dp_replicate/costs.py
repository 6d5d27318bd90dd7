"""What the data-parallel degree `dp_replicate` costs under torch's DDP, for the planner: the
reducer's buckets in a replica's memory, the gradients' all-reduce in bytes and in messages.
"""

from __future__ import annotations

from src.config.parallel import MeshConfig
from src.parallel.shares import Messages, ring_bytes


def bucket_bytes(cfg: MeshConfig, parameter_bytes: int) -> int:
    """What the reducer's buckets add to a replica of `parameter_bytes`: a second copy of the
    gradients, none when the gradients are views into them."""
    return 0 if cfg.gradient_as_bucket_view else parameter_bytes


def replica_traffic(shard_bytes: int, replicas: int, reductions: int = 1) -> dict[str, int]:
    """What each of `replicas` sends per step: a ring all-reduce of its `shard_bytes` of
    gradients, `reductions` times."""
    return {"gradient all-reduce": reductions * ring_bytes(shard_bytes, replicas)}


# DDP's buckets (torch's defaults): the first, reduced as soon as backward starts, is small.
FIRST_BUCKET_BYTES, BUCKET_BYTES = 2**20, 25 * 2**20


def bucketed_all_reduce(size: int, ranks: int, times: int = 1) -> Messages:
    """`size` bytes of gradients all-reduced in DDP's buckets `times` per step, while backward
    computes."""
    buckets = 1 + max(0, -(-(size - FIRST_BUCKET_BYTES) // BUCKET_BYTES))
    each = size // buckets
    return Messages("all_reduce", times * buckets, each, ranks, overlapped=True, wrapper="ddp")
