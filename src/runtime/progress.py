"""Progress on the console, one bar style for every long phase: training steps (a line every
`trainer.log_every` steps, `loop.py`), evaluation batches, checkpoint writes and reads, data
preparation.

    [######..............] val batch 12/40 | eta 9s

A phase other than training shows nothing until it has run `trainer.progress_every_s` (2 s),
then a line at most that often, and one closing line (`<what>: done in 7.1 s`): a short phase
prints nothing extra. Where stdout is a terminal the line is redrawn in place (a `\\r`, no new
line; the closing line is logged); elsewhere (SLURM logs, CI, a file) each is a log line. Only
the main process (rank 0) shows progress.

The cost while nothing is due to be shown is one clock read per `advance`.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

log = logging.getLogger(__name__)

BAR_WIDTH = 20
CLEAR_LINE = "\r\033[K"  # back to the line's start, and erase it


@dataclass
class ProgressSettings:
    """This process's: `every_s` (trainer.progress_every_s; None: phases show nothing), `shown`
    (false on every rank but 0), `stream` (the terminal to redraw on; None: sys.stdout)."""

    every_s: float | None = 2.0
    shown: bool = True
    stream: TextIO | None = None


SETTINGS = ProgressSettings()


def show_progress_every(every_s: float | None) -> None:
    """trainer.progress_every_s, for this process's phases from now on."""
    SETTINGS.every_s = every_s


def show_progress_here(shown: bool) -> None:
    """Whether this process shows progress (rank 0 does, the other ranks do not)."""
    SETTINGS.shown = shown


def bar_line(what: str, done: float, total: float, details: Sequence[str], eta_s: float) -> str:
    """`[####....] <what> | <details> | eta <s>`: the one line style of every phase."""
    filled = min(BAR_WIDTH, round(BAR_WIDTH * done / total)) if total > 0 else BAR_WIDTH
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    return " | ".join((f"[{bar}] {what}", *details, f"eta {eta_s:.0f}s"))


def eta_s(elapsed_s: float, done: float, total: float) -> float:
    """The seconds left at the pace so far."""
    return max(0.0, elapsed_s * (total - done) / done) if done > 0 else float("nan")


class PhaseProgress:
    """How far a phase of `total` units has got (`advance`), shown as `<what> <unit>
    <done>/<total>` (each count through `count_text`) once it has run `SETTINGS.every_s`. A
    context manager: leaving it ends the phase (`finish`)."""

    def __init__(
        self,
        what: str,
        total: float,
        count_text: Callable[[float], str] = lambda n: f"{n:g}",
        unit: str = "",
    ):
        self.what, self.total, self.count_text = what, total, count_text
        self.counted = f"{what} {unit} " if unit else f"{what} "
        self.done = 0.0
        self.started = time.perf_counter()
        every_s = SETTINGS.every_s if SETTINGS.shown else None
        self.every_s = every_s
        self.next_at = float("inf") if every_s is None else self.started + every_s
        self.stream = SETTINGS.stream or sys.stdout
        self.redraws = self.stream.isatty()
        self.shown = False

    def __enter__(self) -> PhaseProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish(failed=exc[0] is not None)

    def advance(self, units: float = 1) -> None:
        self.advance_to(self.done + units)

    def advance_to(self, done: float) -> None:
        self.done = done
        now = time.perf_counter()
        if now >= self.next_at and done > 0:  # nothing done yet: no pace to tell an ETA by
            self.show(now)

    def show(self, now: float) -> None:
        elapsed = now - self.started
        counts = f"{self.counted}{self.count_text(self.done)}/{self.count_text(self.total)}"
        line = bar_line(counts, self.done, self.total, (), eta_s(elapsed, self.done, self.total))
        if self.redraws:
            self.stream.write(CLEAR_LINE + line)
            self.stream.flush()
        else:
            log.info("%s", line)
        self.shown = True
        self.next_at = now + self.every_s

    def finish(self, failed: bool = False) -> None:
        """End the phase: a phase that showed progress says how long it took."""
        if not self.shown:
            return
        if self.redraws:
            self.stream.write(CLEAR_LINE)
            self.stream.flush()
        if not failed:
            log.info("%s: done in %.1f s", self.what, time.perf_counter() - self.started)
        self.shown = False


def size_text(size: int) -> str:
    """`size` bytes in the unit that shows it best: 59 kB, 1.2 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} bytes"
