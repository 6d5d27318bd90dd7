"""Where this process sits among the job's processes (a leaf: imports nothing from the project)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in a job of several processes: read from the environment once
    (`started_ranks`), then handed to whatever needs it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
