"""What ends a run early: a stop signal (SIGINT/SIGTERM, or one `stopping_also_on` adds, such as
SLURM's signal before a time limit), a non-finite loss, or a process of a multi-process job that
died.

Each ends in an exception that `train.py` reports as one message, with an exit code that says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Protocol

import torch

log = logging.getLogger(__name__)


class RunStopped(Exception):
    """Training ended before `trainer.max_steps` for a reason the user can act on.

    It pickles as it is, so that a launched rank can hand it to the launcher as its outcome."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message, exit_code)
        self.exit_code = exit_code

    def __str__(self) -> str:
        return self.args[0]


class Interrupted(RunStopped):
    """Stopped by a stop signal (SIGINT, SIGTERM, ...); the exit code is what a shell reports for
    a process that the signal killed."""

    @classmethod
    def by(cls, signum: int, step: int, checkpoint: Path | None) -> Interrupted:
        name = signal.Signals(signum).name
        saved = f"checkpoint saved to {checkpoint}" if checkpoint else "no checkpoint written"
        return cls(f"stopped by {name} after step {step}; {saved}", 128 + signum)


class ProcessDied(RunStopped):
    """A process of a multi-process job died or failed (a rank, or the rank server that forked
    them), and the launcher stopped the rest; the run resumes from its last checkpoint."""


class NonFiniteLoss(RunStopped):
    @classmethod
    def at(cls, step: int | None, checked_at: int, last_checkpoint: int | None) -> NonFiniteLoss:
        where = f"at step {step}" if step else f"on another process by step {checked_at}"
        kept = (
            f"the last checkpoint (step {last_checkpoint}) is kept"
            if last_checkpoint is not None
            else "no checkpoint was written"
        )
        return cls(
            f"the training loss became non-finite {where}; stopped, and {kept}. Lower "
            "optimizer.lr, set trainer.grad_clip, or set trainer.skip_nonfinite=true to skip "
            "such steps"
        )


class StopOnSignal:
    """Turns SIGINT (Ctrl-C) and SIGTERM into a request to stop after a step.

    A process on its own stops after the current step, and the previous handlers come straight
    back, so that a second signal stops it at once. The ranks of a multi-process job must stop
    after the same step: they settle it in `agree_to_stop`, and hold their handler from start to
    exit (`as_rank.run_as_rank`), so that a signal while they start up or finish
    cannot kill one of them alone. They keep every later signal to themselves, because one
    Ctrl-C reaches each rank twice (from the terminal, and passed on by the launcher); stopping
    them at once is the launcher's call (SIGKILL after a second signal, or parallel.timeout_s).
    `job_failed()` says when a signal is instead the launcher ending a failed job: the rank exits.
    """

    SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)  # and `stopping_also_on`'s

    def __init__(
        self,
        second_signal_stops_at_once: bool = True,
        job_failed: Callable[[], bool] | None = None,
    ) -> None:
        self.signal: int | None = None
        self.second_signal_stops_at_once = second_signal_stops_at_once
        self.job_failed = job_failed
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __enter__(self) -> StopOnSignal:
        self._previous = {signum: signal.signal(signum, self._note) for signum in self.SIGNALS}
        if _received_early:  # by `stopping_also_on`, before training began
            self._note(_received_early.pop(), None)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.job_failed is not None and self.job_failed():
            # Not a request to stop: the launcher ending what is left of a failed job. The flush
            # may meet a write this handler interrupted (see `warn_from_signal_handler`).
            with contextlib.suppress(RuntimeError):
                logging.shutdown()
            os._exit(128 + signum)
        if self.signal is not None:
            return
        self.signal = signum
        name = signal.Signals(signum).name
        if self.second_signal_stops_at_once:
            self._restore()
            warn_from_signal_handler(
                log,
                "%s received: stopping after the current step (send it again to stop at once)",
                name,
            )
        else:
            warn_from_signal_handler(
                log,
                "%s received: stopping with the other processes at the next step they log, "
                "evaluate or checkpoint",
                name,
            )

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


def warn_from_signal_handler(
    logger: logging.Logger, message: str, *args: object
) -> threading.Thread:
    """`logger.warning` from a signal handler, on a thread of its own. The handler runs inside
    the code it interrupted, which may be halfway through writing to the same stream (say, a full
    stdout pipe): a second write from the same thread is refused by the io module ("reentrant
    call"), and logging prints a traceback instead of the message. The thread waits for that
    write to end."""
    thread = threading.Thread(target=logger.warning, args=(message, *args))
    thread.start()
    return thread


_received_early: list[int] = []


@contextlib.contextmanager
def stopping_also_on(signum: int, received_already: bool = False) -> Iterator[None]:
    """While it lasts, `signum` stops a run in this process as SIGTERM does; one that comes before
    training has begun (or `received_already`) stops it after its first step. Every rank of a
    job must enter it alike: the ranks agree on a stop by counting each of StopOnSignal.SIGNALS."""
    saved = StopOnSignal.SIGNALS
    if signum not in saved:
        StopOnSignal.SIGNALS = (*saved, signum)
    if received_already:
        _received_early.append(signum)
    previous = signal.signal(signum, lambda received, frame: _received_early.append(received))
    try:
        yield
    finally:
        StopOnSignal.SIGNALS = saved
        signal.signal(signum, previous)
        _received_early.clear()


class NonFiniteWatch:
    """Finds the first step whose loss was NaN or infinite, without waiting on the device and
    without device work per step.

    `observe` only keeps a reference to each step's sums; `pending`, called on steps that
    synchronize anyway (logging, eval, checkpoint), checks them all at once. A per-step check
    costs several kernel launches a step (host time that shows on a fast GPU step), and a
    per-step `.item()` would make the host wait for every step and lose the overlap of queueing
    step k+1 while step k runs."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.sums: list[torch.Tensor] = []

    def observe(self, step: int, sums: torch.Tensor) -> None:
        self.steps.append(step)
        self.sums.append(sums)

    def pending(self) -> torch.Tensor | None:
        """Whether each step observed since the last `clear` had a non-finite loss (a bool
        tensor on the device, nothing read back yet); None when no step was observed."""
        if not self.sums:
            return None
        return ~torch.stack(self.sums)[:, 0].isfinite()

    def first_bad_step(self, bad: torch.Tensor) -> int | None:
        """The first step that `pending` flagged (reads the flags back), or None."""
        flagged = bad.nonzero()
        return self.steps[int(flagged[0])] if len(flagged) else None

    def clear(self) -> None:
        self.steps, self.sums = [], []


class Collective(Protocol):
    """What `agree_to_stop` needs of the processes of a run (a strategy is one)."""

    world_size: int

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...


def agree_to_stop(
    strategy: Collective,
    nonfinite: NonFiniteWatch,
    stop: StopOnSignal,
    step: int,
    in_sync: bool,
    last_checkpoint: int | None,
) -> int | None:
    """What every process must do after `step`, settled in one all-reduce on a step where they
    synchronize anyway (`in_sync`: log, eval, checkpoint): raises NonFiniteLoss if any process
    has seen a non-finite loss; returns the signal to stop for if any process has received one,
    else None. A process on its own settles it as soon as a signal comes.
    """
    if not (in_sync or (stop.requested and strategy.world_size == 1)):
        return None
    bad = nonfinite.pending()
    # Read once: a signal that lands during the all-reduce must wait for the next agreement,
    # or this process would decide on what the others did not see.
    received_here = stop.signal
    received = [float(received_here == signum) for signum in StopOnSignal.SIGNALS]
    flags = torch.tensor([0.0, *received], device=bad.device if bad is not None else "cpu")
    if bad is not None:
        flags[0] = bad.sum()
    any_bad, *signal_counts = strategy.all_reduce_sum(flags).tolist()
    if any_bad > 0:
        first_bad = nonfinite.first_bad_step(bad) if bad is not None else None
        raise NonFiniteLoss.at(first_bad, step, last_checkpoint)
    nonfinite.clear()
    if not any(signal_counts):
        return None
    counted = zip(StopOnSignal.SIGNALS, signal_counts, strict=True)
    return received_here or next(signum for signum, count in counted if count)
