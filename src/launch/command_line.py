"""What the Hydra entry points (`train.py`, `eval.py`) share: bad input and expected failures
reported in one line, with an exit code, instead of a traceback.

    with exit_without_teardown(), composition_errors_in_one_line("eval.py"):
        main()                   # a @hydra.main function that calls `config_composed()` first

Imports nothing heavy (no torch): `--help` and config errors stay fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator

from hydra.errors import ConfigCompositionException, OverrideParseException

from src.config.base import ConfigError
from src.config.schema import composition_error_line

log = logging.getLogger(__name__)
# Hydra lets its errors through to the caller, instead of reporting them itself (several lines,
# exit code 1), while this variable is "1". It is set for as long as Hydra composes the config
# (see `composition_errors_in_one_line`), unless the user has set it.
LET_ERRORS_THROUGH = "HYDRA_FULL_ERROR"
composing = False


@contextlib.contextmanager
def composition_errors_in_one_line(program: str) -> Iterator[None]:
    """A config Hydra cannot compose (a misspelt key, a wrong type, an unknown option, an
    override it cannot parse) ends with one `<program>: error: ...` line and exit code 2, like
    every other bad input. (A sweep composes every job's config before it runs the first.) With
    HYDRA_FULL_ERROR=1 set by the user, Hydra's own report stays, with its traceback."""
    global composing
    composing = os.environ.get(LET_ERRORS_THROUGH) != "1"
    if composing:
        os.environ[LET_ERRORS_THROUGH] = "1"
    try:
        yield
    except (ConfigCompositionException, OverrideParseException) as error:
        if not composing:  # the user's HYDRA_FULL_ERROR=1 asks for the traceback
            raise
        exit_with_error(program, composition_error_line(error))


def config_composed() -> None:
    """Called first thing in the Hydra job: composed, from here on Hydra reports errors its own
    way."""
    global composing
    if composing:
        del os.environ[LET_ERRORS_THROUGH]
        composing = False


def exit_with_error(program: str, line: str) -> None:
    """Bad input found before Hydra runs the job (no log yet): one line on stderr, exit code 2."""
    print(f"{program}: error: {line}", file=sys.stderr)
    sys.exit(ConfigError.exit_code)


def expected_failures_in_one_line(job: Callable[[], float], hint: Callable[[], str]) -> float:
    """`job()`, whose expected failures get one logged message and an exit code instead of a
    traceback: bad input (exit code 2), a run stopped (by a signal, a non-finite loss: then
    `hint()` says how to go on) or a process of the job that died. In a multirun,
    `sweep.run_job` records how each job ended and the sweep goes on; a signal still stops it."""
    from src.runtime.stopping import Interrupted, ProcessDied, RunStopped

    try:
        return job()
    except (Interrupted, ProcessDied) as stop:
        log.error("%s; %s", stop, hint())
        sys.exit(stop.exit_code)
    except (ConfigError, RunStopped) as error:
        log.error("%s", error)
        sys.exit(error.exit_code)
