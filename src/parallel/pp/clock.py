"""How long a pp rank computes in each training step, against the step's wall time: the
measured idle fraction (the bubble, and the sends)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage


class StageClock:
    """How long this rank computes in each training micro-step's `schedule.step`: its stages'
    forward and backward chunks and the loss (timed where the schedule calls them), against the
    step's wall time. The rest of the step the rank waited for its peers' activations or
    gradients (the bubble) or sent its own; the idle fraction is that rest's share, over every
    step but the first (which also infers the stages' shapes). On CUDA every reading waits for
    the device's queued work."""

    def __init__(self, device: torch.device):
        self.device = device
        self.computing_s = 0.0  # in the timed calls, so far
        self.steps: list[tuple[float, float]] = []  # (wall, computing) seconds of each step

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def timed(self, work: Callable) -> Callable:
        @functools.wraps(work)
        def timed_work(*args: Any, **kwargs: Any) -> Any:
            started = self.now()
            try:
                return work(*args, **kwargs)
            finally:
                self.computing_s += self.now() - started

        return timed_work

    def time_stages(self, stages: list[PipelineStage]) -> None:
        """Time each stage's chunks (those of the split backward too) where the schedule calls
        them."""
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self.timed(getattr(stage, name)))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        started, computed = self.now(), self.computing_s
        yield
        self.steps.append((self.now() - started, self.computing_s - computed))

    def idle_fraction(self) -> float | None:
        """None before two steps have run."""
        timed = self.steps[1:]
        if not timed:
            return None
        wall = sum(step_s for step_s, _ in timed)
        return 1 - sum(computing_s for _, computing_s in timed) / wall
