"""A stop signal's message while the interrupted code is writing the same log stream."""

from __future__ import annotations

import array
import fcntl
import logging
import os
import signal
import termios
import threading
import weakref

import pytest

from src.runtime.stopping import StopOnSignal, warn_from_signal_handler


def test_a_signal_during_a_blocked_log_write_still_logs_its_message(monkeypatch):
    """SIGINT reaches the main thread while it is blocked writing a long log line to a full pipe:
    the handler's message comes after that line, whole, and logging reports no error (a write
    from inside the handler would be a reentrant call on the same buffered stream)."""
    read_end, write_end = os.pipe()
    stream = open(write_end, "w", buffering=1)  # noqa: SIM115 - closed after the handler thread
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("src.runtime.stopping")
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "propagate", False)
    errors: list[logging.LogRecord] = []
    monkeypatch.setattr(handler, "handleError", errors.append)
    threads: list[threading.Thread] = []

    def recording(*args: object) -> threading.Thread:
        threads.append(warn_from_signal_handler(*args))
        return threads[-1]

    monkeypatch.setattr("src.runtime.stopping.warn_from_signal_handler", recording)
    received: list[bytes] = []

    def signal_when_full_then_read() -> None:
        capacity = fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ)
        queued = array.array("i", [0])
        while queued[0] < capacity:  # the main thread's write blocks from here on
            fcntl.ioctl(read_end, termios.FIONREAD, queued)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        while chunk := os.read(read_end, 1 << 16):
            received.append(chunk)

    reader = threading.Thread(target=signal_when_full_then_read)
    long_line = "x" * (4 << 20)
    with StopOnSignal() as stop:
        reader.start()
        logger.warning(long_line)
    for thread in threads:
        thread.join()
    stream.close()
    reader.join()
    os.close(read_end)

    assert stop.signal == signal.SIGINT and len(threads) == 1
    assert not errors
    assert b"".join(received).decode().splitlines() == [
        long_line,
        "SIGINT received: stopping after the current step (send it again to stop at once)",
    ]


class Referent:
    pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one
def test_a_kill_signal_whose_exception_python_drops_is_still_known_to_the_launcher():
    """A stop signal handled while a weakref callback runs: the handler's KilledBySignal is
    dropped there ("Exception ignored in"), but `stop_signals_passed_to_ranks` keeps the signal
    for `launch` to raise (seen: a second Ctrl-C during torch's agent's clean-up, exit 1)."""
    from src.launch.launcher import stop_signals_passed_to_ranks

    with stop_signals_passed_to_ranks() as killing:
        referent = Referent()
        # No ranks run: the first signal already kills, inside the callback.
        reference = weakref.ref(referent, lambda _: os.kill(os.getpid(), signal.SIGTERM))
        del referent  # the callback runs; its signal's exception goes nowhere
        assert reference() is None
    assert killing == [signal.SIGTERM]
