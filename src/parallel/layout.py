"""The degrees of an N-D layout (torchtitan's ParallelDims) and the named DeviceMesh over them.

A job of W processes is a grid pp x dp_replicate x dp_shard x cp x tp, in that order, tp varying
fastest (the peers that talk most, TP's, get neighbouring ranks: one node, NVLink; cp's ring
next). A degree of -1 takes the ranks the others leave. Ranks that share a data-parallel index
(the same dp_replicate and dp_shard coordinates) read the same batch (cp's ranks each keep a
share of every sequence of it); data-parallel rank d of D reads
`global batch / D` samples, as a ddp rank of D would, so the global batch means what it means
under `single`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from src.config.base import ConfigError

DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert-parallel ranks, borrowed from dp_shard (a divisor of it, not a dimension of the
    grid: `ep/`)."""

    @classmethod
    def of(cls, world_size: int, **degrees: int) -> Layout:
        """The layout of `world_size` ranks with these degrees (one of them may be -1: the ranks
        the others leave); ConfigError, in one line, when they do not multiply out."""
        unknown = [name for name, degree in degrees.items() if degree == -1]
        bad = [
            f"{name}={degree}" for name, degree in degrees.items() if degree < 1 and degree != -1
        ]
        if bad or len(unknown) > 1:
            raise ConfigError(
                f"parallel.{', parallel.'.join(bad or [f'{name}=-1' for name in unknown])}: each "
                "degree must be at least 1, and at most one may be -1 (the remaining ranks)"
            )
        known = math.prod(degree for degree in degrees.values() if degree != -1)
        shown = " x ".join(f"{name} {degree}" for name, degree in degrees.items())
        if unknown:
            if world_size % known:
                raise ConfigError(
                    f"the degrees ({shown}) leave no whole number of ranks for "
                    f"parallel.{unknown[0]} out of {world_size} processes; change the degrees or "
                    "parallel.devices"
                )
            degrees[unknown[0]] = world_size // known
        elif known != world_size:
            raise ConfigError(
                f"the degrees multiply to {known} ({shown}) but the job has {world_size} processes "
                "(parallel.devices x parallel.nodes); make them equal, or set one degree to -1"
            )
        return cls(**degrees)

    @property
    def dp(self) -> int:
        """Data-parallel processes: replicas (ddp), shards (fsdp), or both (hsdp)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shards(self) -> int:
        """The ranks FSDP2 shards over: dp_shard's, and cp's with them (`sharding_mesh`)."""
        return self.dp_shard * self.cp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index along each dimension (row-major over DIMENSIONS)."""
        found = {}
        for name in reversed(DIMENSIONS):
            rank, found[name] = divmod(rank, getattr(self, name))
        return {name: found[name] for name in DIMENSIONS}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel share of the batch `rank` reads."""
        where = self.coordinates(rank)
        return where["dp_replicate"] * self.dp_shard + where["dp_shard"]

    @classmethod
    def of_settings(cls, world_size: int, settings: Any) -> Layout:
        """The layout `parallel.<degree>` settings give `world_size` ranks (`of`'s checks)."""
        return cls.of(world_size, **{name: getattr(settings, name) for name in DIMENSIONS})

    def named_by(self, preset: str) -> bool:
        """Whether the preset's name says this layout already: its one degree (`fsdp` for
        fsdp4), or `single` for one rank, so that reports and sweep tables keep the name."""
        return re.sub(r"\d+", "", self.label()) in (preset, "single")

    def label(self) -> str:
        """A strategy name for reports: `fsdp2xtp2`, `ddp2xpp2`, `cp2` (degrees above 1 only)."""
        parts = [
            f"{name}{degree}"
            for name, degree in (
                ("ddp", self.dp_replicate if self.dp_shard == 1 else 1),
                ("hsdp", self.dp_replicate if self.dp_shard > 1 else 1),
                ("fsdp", self.dp_shard),
                ("ep", self.ep),
                ("cp", self.cp),
                ("tp", self.tp),
                ("pp", self.pp),
            )
            if degree > 1
        ]
        return "x".join(parts) or "single"

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """One DeviceMesh with every dimension named (those of size 1 too, so that code can ask
        for `mesh["tp"]` whatever the layout), and the two data-parallel ones flattened into
        one, kept: torch warns that slicing a flattened dimension from the root is going away."""
        shape = tuple(getattr(self, name) for name in DIMENSIONS)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMENSIONS)
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def sharding_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP2 runs over: the shards are dp_shard's ranks, and cp's with them
        (torchtitan's dp_shard_cp), since the cp ranks of one data-parallel index compute
        gradients of different tokens of the same samples, to be summed; under HSDP, 2-D
        (dp_replicate, shards), else the shards alone: the parameters are DTensors on this mesh,
        and the first time an op runs on them DTensor propagates its sharding over each of its
        dimensions, one of size 1 too."""
        if self.cp == 1:
            return mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else mesh["dp_shard"]
        flat = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        if self.dp_replicate == 1:
            return flat
        shape, names = (self.dp_replicate, self.fsdp_shards), ("dp_replicate", "dp_shard_cp")
        return flat._unflatten(0, shape, names)
