"""How the calibration times a piece of work: rounds of it, each timed whole. The best round is
the machine's speed, not its neighbours' (arithmetic); the median round is what a step among
processes typically waits (a collective, a wrapper's step: their waits on peers vary)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

ROUNDS = 3
TYPICAL_ROUNDS = 7


def round_times_s(
    work: Callable[[], Any],
    device: torch.device,
    repeats: int,
    rounds: int,
    before_round: Callable[[], Any] | None,
) -> list[float]:
    """Each of `rounds` timed runs of `work` `repeats` times (after one untimed), per run of
    `work`; `before_round` (untimed) starts each round, e.g. a barrier of the ranks timed
    together."""

    def synchronized() -> None:
        for _ in range(repeats):
            work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    synchronized()
    times = []
    for _ in range(rounds):
        if before_round is not None:
            before_round()
        started = time.perf_counter()
        synchronized()
        times.append((time.perf_counter() - started) / repeats)
    return times


def best_time_s(work: Callable[[], Any], device: torch.device, repeats: int = 1) -> float:
    """The shortest of `ROUNDS` rounds of `work` (`round_times_s`), per run of `work`."""
    return min(round_times_s(work, device, repeats, ROUNDS, None))


def typical_time_s(
    work: Callable[[], Any],
    device: torch.device,
    repeats: int,
    before_round: Callable[[], Any] | None = None,
) -> float:
    """The median of `TYPICAL_ROUNDS` rounds of `work` (`round_times_s`), per run of `work`."""
    return statistics.median(round_times_s(work, device, repeats, TYPICAL_ROUNDS, before_round))
