"""What ends a run early: a stop signal (SIGINT/SIGTERM) or a non-finite loss.

Both end in an exception that `train.py` reports as one message, with an exit code that says why.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import FrameType

import torch

from src.strategies.base import Strategy

log = logging.getLogger(__name__)


class RunStopped(Exception):
    """Training ended before `trainer.max_steps` for a reason the user can act on."""

    exit_code = 1


class Interrupted(RunStopped):
    def __init__(self, signum: int, step: int, checkpoint: Path):
        self.exit_code = 128 + signum  # what a shell reports for a process the signal killed
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}; checkpoint saved to {checkpoint}")


class NonFiniteLoss(RunStopped):
    def __init__(self, step: int | None, checked_at: int, last_checkpoint: int | None):
        where = f"at step {step}" if step else f"on another process by step {checked_at}"
        kept = (
            f"the last checkpoint (step {last_checkpoint}) is kept"
            if last_checkpoint is not None
            else "no checkpoint was written"
        )
        super().__init__(
            f"the training loss became non-finite {where}; stopped, and {kept}. Lower "
            "optimizer.lr, set trainer.grad_clip, or set trainer.skip_nonfinite=true to skip "
            "such steps"
        )


class StopOnSignal:
    """Turns the first SIGINT (Ctrl-C) or SIGTERM into a request that the loop honours after the
    current step. The previous handlers come straight back, so a second signal stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __enter__(self) -> StopOnSignal:
        self._previous = {signum: signal.signal(signum, self._note) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum
        self._restore()
        log.warning(
            "%s received: stopping after the current step (send it again to stop at once)",
            signal.Signals(signum).name,
        )

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


class NonFiniteWatch:
    """Remembers the first step whose loss was NaN or infinite, without waiting on the device.

    `observe` queues two tiny ops on the loss's device per step; only `check`, called on steps
    that synchronize anyway (logging, eval, checkpoint), reads the result back. A per-step
    `.item()` would make the host wait for every step on a GPU and lose the overlap of queueing
    step k+1 while step k runs."""

    def __init__(self) -> None:
        self.first_step: torch.Tensor | None = None  # 0 while every loss has been finite

    def observe(self, step: int, loss: torch.Tensor) -> None:
        bad_step = torch.where(torch.isfinite(loss), 0.0, float(step))
        if self.first_step is None:
            self.first_step = bad_step
        else:
            self.first_step = torch.where(self.first_step > 0, self.first_step, bad_step)

    def check(self, strategy: Strategy, step: int, last_checkpoint: int | None) -> None:
        """Raise NonFiniteLoss if any process has seen a non-finite loss (all agree)."""
        if self.first_step is None:
            return
        if strategy.all_reduce_sum(self.first_step.clone()).item() > 0:
            raise NonFiniteLoss(int(self.first_step.item()), step, last_checkpoint)
