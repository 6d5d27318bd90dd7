"""Ending a finished process without the interpreter's teardown of its modules.

A training process has imported torch, torch._dynamo (every `torch.optim` optimizer does),
sympy, Hydra and W&B. When it exits, Python frees all of their modules object by object, which
takes longer than any short run's training: 0.4 s after `import torch` alone and 0.8 s after
`import torch._dynamo` on this project's 2-core machine (`/usr/bin/time python -c ...` with and
without `os._exit(0)` at the end). A sweep of short jobs, and every test, pays it per process.

By then nothing the process owes anyone is left in that teardown: Python has already waited for
its non-daemon threads and run the exit handlers (W&B's, multiprocessing's, ...) when the last
of them, registered first by `exit_without_teardown`, flushes the logs and standard streams and
ends the process with its exit status. Processes forked by multiprocessing (the ranks, loader
workers) end this way already. An exit the process did not reach on its own terms (an uncaught
exception, a message given to `sys.exit`) keeps Python's usual path and report.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Iterator

_exit_status: list[int] = []  # set once the block has ended with an exit status of its own


def _end_at_once() -> None:
    if not _exit_status:
        return
    logging.shutdown()  # its own exit handler may be one that runs after this one
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream
            stream.flush()
    os._exit(_exit_status[0])


@contextlib.contextmanager
def exit_without_teardown() -> Iterator[None]:
    """Around a command's whole run: once it returns or calls `sys.exit(code)`, the process ends
    after the exit handlers, skipping the teardown of its modules."""
    atexit.register(_end_at_once)  # exit handlers run last-registered first: this one last
    try:
        yield
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            _exit_status.append(exit.code or 0)
        raise
    _exit_status.append(0)
