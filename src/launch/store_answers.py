"""Questions to the job's store that must not block: a rank's failure report, and a launcher
leaving the rendezvous. Light on imports: a rank's signal handler asks them, and an import
begun in a handler can be entered again by the next signal (Ctrl-C reaches a rank twice: from
the terminal and from its launcher), which then finds the module half made."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

# How long a launched rank, or a launcher leaving the rendezvous, waits for the job's store (the
# first node's launcher hosts it) to answer what takes it milliseconds: longer, and the store is
# gone, or the network to it (a lost node, a partition). Without this bound, a rank failing on the
# far side of a partition waits 30 minutes to report it, and its launcher 60 s to leave.
STORE_ANSWER_S = 5.0

Answer = TypeVar("Answer")


def answer_within(seconds: float, question: Callable[[], Answer]) -> Answer | None:
    """`question()`'s answer, or None if it raised or has not answered within `seconds` (it then
    goes on in a daemon thread that nothing waits for). torch's TCPStore bounds a wait for a key
    by its timeout, but not a question to a server out of reach: seen, an `add` across a
    partition still blocked after 40 s, its timeout 5 s."""
    answers = []

    def ask() -> None:
        with contextlib.suppress(Exception):
            answers.append(question())

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(seconds)
    return answers[0] if answers else None
