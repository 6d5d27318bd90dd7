"""How the calibration times a piece of work: the best of a few rounds, so that the figure is the
machine's speed, not its neighbours'."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

ROUNDS = 3


def best_time_s(
    work: Callable[[], Any],
    device: torch.device,
    repeats: int = 1,
    before_round: Callable[[], Any] | None = None,
) -> float:
    """The shortest of `ROUNDS` timed runs of `work` `repeats` times (after one untimed), per
    run of `work`; `before_round` (untimed) starts each round, e.g. a barrier of the ranks
    timed together."""

    def synchronized() -> None:
        for _ in range(repeats):
            work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    synchronized()
    times = []
    for _ in range(ROUNDS):
        if before_round is not None:
            before_round()
        started = time.perf_counter()
        synchronized()
        times.append((time.perf_counter() - started) / repeats)
    return min(times)
