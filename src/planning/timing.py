"""How the calibration times a piece of work: rounds of it, each timed whole. The best round is
the machine's speed, not its neighbours' (arithmetic); the median round is what a step among
processes typically waits (a collective, a wrapper's step: their waits on peers vary)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

ROUNDS = 3
TYPICAL_ROUNDS = 7


def round_times_s(
    works: Sequence[Callable[[], Any]],
    device: torch.device,
    repeats: Sequence[int],
    rounds: int,
    before_round: Callable[[], Any] | None,
) -> list[list[float]]:
    """For each of `works`, its `rounds` timed runs of its `repeats` times (after one untimed),
    per run; the works take turns round by round, so that each meets the machine's slow swings
    (another process's burst, a core's frequency) as often as the others. `before_round`
    (untimed) starts each round, e.g. a barrier of the ranks timed together."""

    def synchronized(work: Callable[[], Any], times: int) -> None:
        for _ in range(times):
            work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for work, times in zip(works, repeats, strict=True):
        synchronized(work, times)
    taken: list[list[float]] = [[] for _ in works]
    for _ in range(rounds):
        for work, times, each in zip(works, repeats, taken, strict=True):
            if before_round is not None:
                before_round()
            started = time.perf_counter()
            synchronized(work, times)
            each.append((time.perf_counter() - started) / times)
    return taken


def best_time_s(work: Callable[[], Any], device: torch.device, repeats: int = 1) -> float:
    """The shortest of `ROUNDS` rounds of `work` (`round_times_s`), per run of `work`."""
    return best_times_s([work], device, repeats)[0]


def best_times_s(
    works: Sequence[Callable[[], Any]], device: torch.device, repeats: int = 1
) -> list[float]:
    """Each of `works`' shortest of `ROUNDS` rounds, taken in turns (`round_times_s`), per run."""
    rounds = round_times_s(works, device, [repeats] * len(works), ROUNDS, None)
    return [min(each) for each in rounds]


def typical_times_s(
    works: Sequence[Callable[[], Any]],
    device: torch.device,
    repeats: Sequence[int],
    before_round: Callable[[], Any] | None = None,
    rounds: int = TYPICAL_ROUNDS,
) -> list[float]:
    """Each of `works`' median of `rounds` rounds of its `repeats`, taken in turns
    (`round_times_s`), per run."""
    return [
        statistics.median(each)
        for each in round_times_s(works, device, repeats, rounds, before_round)
    ]


def typical_time_s(
    work: Callable[[], Any],
    device: torch.device,
    repeats: int,
    before_round: Callable[[], Any] | None = None,
) -> float:
    """The median of `TYPICAL_ROUNDS` rounds of `work` (`round_times_s`), per run of `work`."""
    return typical_times_s([work], device, [repeats], before_round)[0]
