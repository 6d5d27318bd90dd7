"""What the data-parallel degree `dp_replicate` costs under torch's DDP, for the planner: the
reducer's buckets in a replica's memory, the gradients' all-reduce in bytes and in messages, and
`DDPCosts`, the cost model of dp_replicate alone (`Replicated`).
"""

from __future__ import annotations

from dataclasses import dataclass

from src.config.parallel import MeshConfig
from src.parallel.shares import DeviceShare, Messages, ModelSizes, ring_bytes
from src.parallel.stages.costs import StageCosts


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


@dataclass(frozen=True)
class DDPCosts:
    """What the planner prices `replicas` DDP replicas with: rank 0's replica (its stages under
    the stage cut) on its share of the batch with the reducer's buckets, and the gradients'
    all-reduce once per step (no_sync skips the other micro-steps; the stage cut's copies stay
    in the process)."""

    cfg: MeshConfig
    device_type: str
    replicas: int
    stages: StageCosts | None  # the stage cut's, each stage with the buckets' gradient copy

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        samples = micro_batch // self.replicas
        if self.stages is not None:
            return self.stages.device_shares(sizes, samples)
        buckets = bucket_bytes(self.cfg, sizes.parameter_bytes)
        return [DeviceShare(f"{self.device_type}:0", samples, extra_bytes={"gradients": buckets})]

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        samples = micro_batch // self.replicas
        stages = self.stages.step_traffic(sizes, samples, accumulate) if self.stages else {}
        return {**stages, **replica_traffic(sizes.parameter_bytes, self.replicas)}

    def step_messages(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> list[Messages]:
        return [bucketed_all_reduce(sizes.parameter_bytes, self.replicas)]

    def idle_fraction(self) -> float:
        return self.stages.idle_fraction() if self.stages is not None else 0.0
