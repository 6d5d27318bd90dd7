"""The rank server: the process that forks the ranks `launch` starts (multiprocessing's
forkserver, preloaded with `src.launch.rank_server`), and what ties each rank's life to the
launcher's, so that a launcher killed at any moment leaves no rank behind.

torch is imported inside the functions that need it, so that `train.py --help` stays fast.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib
import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path

from src.runtime.torch_private import (
    forkserver_forked_from_this_process,
    rank_server_pid,
)

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def start_rank_server() -> int | None:
    """Start this process's rank server, once: multiprocessing's forkserver, which imports torch
    and the training code (`src.launch.rank_server`) now, while this process checks the run, and
    then forks each rank that `launch` starts. A rank forked from it is ready in a moment, where a
    spawned one spent seconds importing (and a sweep's later jobs reuse the server). It forks from
    a process that has run nothing: no CUDA context, no OpenMP threads. Where this process has
    done the server's imports already and is as bare (`holds_rank_server_imports`), the server is
    a fork of it. Returns its pid (the ranks' parent), or None where it cannot be read
    (`rank_server_pid`)."""
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload([RANK_SERVER])
    # Python 3.11 starts the server without this process's sys.path: name the repository.
    repository = str(Path(__file__).resolve().parents[2])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [repository, saved]))
    forked = forkserver_forked_from_this_process() if holds_rank_server_imports() else None
    try:
        with forked or contextlib.nullcontext():
            forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return rank_server_pid()


RANK_SERVER = "src.launch.rank_server"
RANK_SERVER_IMPORTS = ("torch._dynamo", "src.launch.job")  # what it imports, seconds of them
# What each rank would import on its way, after these (the mesh strategies, with DTensor's
# experimental parts and pipelining; DCP's state dicts): imported by the server, once for all its
# ranks (docs/performance.md has the figure).
RANKS_IMPORT = (
    "src.parallel.strategies.mesh",
    "src.parallel.strategies.replicated",
    "torch.distributed.checkpoint.state_dict",
)


def import_rank_modules() -> None:
    """Import what the rank server holds for its ranks: `RANK_SERVER_IMPORTS`, then
    `RANKS_IMPORT`."""
    for module in (*RANK_SERVER_IMPORTS, *RANKS_IMPORT):
        importlib.import_module(module)


def holds_rank_server_imports() -> bool:
    """Whether a fork of this process would be the rank server a new interpreter makes, seconds
    sooner: it has imported what the server imports (a test's preloaded run, a launch from
    Python), but not the server's own module, whose top level must run in the server; and it runs
    one thread, so that no OpenMP pool or CUDA context is running to be inherited."""
    if RANK_SERVER in sys.modules or not all(name in sys.modules for name in RANK_SERVER_IMPORTS):
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # not Linux: no way to tell, so no fork
        return False


def die_with_parent() -> None:
    """From now on (Linux), the kernel SIGKILLs this process the moment its parent dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))


def end_with_launcher(server_pid: int | None) -> None:
    """From now on, the kernel kills this rank the moment the rank server that forked it dies,
    which dies with the launcher (`src.launch.rank_server`); and the rank exits at once if the
    server is already gone.

    Without this, a launcher killed while its ranks start leaves them behind: torch asks for a
    SIGINT on the parent's death, but a rank blocked in C++ (connecting to the launcher's store,
    meeting the others in the process group) cannot run a Python signal handler until that call
    gives up, minutes later. With the launcher gone nobody collects the ranks' results, and a
    checkpoint is never half-written, so nothing is lost by SIGKILL."""
    die_with_parent()
    # Checked after prctl: a server that died before it would never signal this rank.
    if server_pid is not None and os.getppid() != server_pid:
        os._exit(128 + signal.SIGKILL)


def become_forked_child(server_pid: int | None, launcher_environment: dict[str, str]) -> None:
    """What a process the rank server forked does first: it dies with the launcher
    (`end_with_launcher`), takes the launcher's environment (`take_launcher_environment`), and
    ends on SIGTERM again (the server ignores it, `src.launch.rank_server`)."""
    end_with_launcher(server_pid)
    take_launcher_environment(launcher_environment)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def take_launcher_environment(launcher_environment: dict[str, str]) -> None:
    """This rank's environment as a rank spawned now would have it: the launcher's at launch (it
    may have changed since the server started, e.g. by a sweep job's `hydra.job.env_set`), plus
    what torch's agent set for the rank (RANK, MASTER_PORT, ...)."""
    server = sys.modules.get("src.launch.rank_server")
    if server is None:  # not preloaded: the environment is the launcher's when it started
        return
    set_by_agent = {
        key: value for key, value in os.environ.items() if server.ENVIRONMENT.get(key) != value
    }
    os.environ.clear()
    os.environ.update({**launcher_environment, **set_by_agent})
