"""`python train.py ...` for the tests, forked from a process that has already imported what every
run imports (torch, torch._dynamo, Hydra, the template, wandb), instead of a new interpreter
importing it all again: about 3 s of CPU per run, and the suite starts some 180 runs.

Each pytest worker starts one such preloader (`python tests/train_forks.py`) on its first run.
For each run it forks a child that becomes what `python train.py <args>` would have been: its
own session, the given stdin, stdout and stderr, the repository as its working directory and
first import path, and train.py run as `__main__` with that argv, ending the way the interpreter
ends any script; given a network namespace (`ip netns add`'s), it joins it first, as `ip netns
exec` would. The preloader reports the child's pid and, once it has ended, its exit status as
`subprocess.Popen` would (`-N` for signal N), through a socket of the child's own.

Only runs with the preloader's environment, but for variables read at run time, are forked
(`forked_train`), with their own environment in os.environ: torch reads some
variables when it is imported (OMP_NUM_THREADS, ATEN_CPU_CAPABILITY), and a fork's
/proc/<pid>/environ keeps the preloader's (the tests find a job's processes by its session
instead: `helpers.processes_of_session`). The preloader runs no thread (a fork copies only its
caller), and the test environment's OMP_NUM_THREADS=1 keeps torch from starting one; where one
runs, it does not serve.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATUS = struct.Struct("i")  # a pid, then the exit status
NETNS_DIR = Path("/run/netns")  # where `ip netns add` keeps its namespaces
CLONE_NEWNET = 0x40000000


def serve(control: socket.socket) -> list[str] | None:
    """Fork a child for each request on `control` and report on it; return in each child, with
    its argv (the parent returns None once its client has closed `control` and every child it
    started has been reported)."""
    watched: dict[int, tuple[int, socket.socket]] = {}  # pidfd: (pid, status socket)
    listening = [control]
    while listening or watched:
        ready, _, _ = select.select([*listening, *watched], [], [])
        for source in ready:
            if source is not control:
                pid, status = watched.pop(source)
                os.close(source)
                _, wait_status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # a client that no longer waits for it
                    status.sendall(STATUS.pack(os.waitstatus_to_exitcode(wait_status)))
                status.close()
                continue
            request, fds, _, _ = socket.recv_fds(control, 1 << 16, 4)
            if not request:
                listening = []
                continue
            argv, cwd, env, netns = json.loads(request)
            *standard, status_fd = fds
            sys.stdout.flush(), sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                control.close()
                for pidfd, (_, other) in watched.items():
                    os.close(pidfd), other.close()
                os.close(status_fd)
                become_run(standard, cwd, env, netns)
                return argv
            for fd in standard:
                os.close(fd)
            status = socket.socket(fileno=status_fd)
            status.sendall(STATUS.pack(pid))
            watched[os.pidfd_open(pid)] = (pid, status)
    return None


def become_run(standard: list[int], cwd: str, env: dict[str, str], netns: str | None) -> None:
    """What a new `python train.py` started by Popen(start_new_session=True) would be (behind
    `ip netns exec <netns>`, given one)."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    for target, fd in enumerate(standard):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    sys.path[0] = cwd  # the script's folder, as `python train.py` puts it first
    if netns is not None:  # after the outputs: a failure is the run's, on its stderr
        join_network_namespace(netns)


def join_network_namespace(name: str) -> None:
    """setns(2) into network namespace `name`, for this thread, the only one (Python 3.11 has no
    os.setns). What else `ip netns exec` does, the runs do not need: it bind-mounts the files of
    /etc/netns/<name> (none here) and remounts /sys (gloo finds GLOO_SOCKET_IFNAME by netlink)."""
    libc = ctypes.CDLL(None, use_errno=True)
    namespace = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(namespace, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into network namespace {name}: {os.strerror(error)}")
    finally:
        os.close(namespace)


class ForkedProcess:
    """A forked run, with the part of `subprocess.Popen`'s interface the tests use."""

    def __init__(self, pid: int, status: socket.socket):
        self.pid, self.status, self.returncode = pid, status, None
        self.stdout = self.stderr = None  # read ends, for `communicate`

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.status], [], [], 0)[0]:
            (self.returncode,) = STATUS.unpack(self.status.recv(STATUS.size, socket.MSG_WAITALL))
            self.status.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self.status], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(["train.py"], timeout)
        return self.poll()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[bytes, bytes]:
        """Both outputs to their ends, then the exit status (as Popen's, for PIPE outputs)."""
        output = {self.stdout: b"", self.stderr: b""}
        with selectors.DefaultSelector() as selector:
            for pipe in output:
                selector.register(pipe, selectors.EVENT_READ)
            while selector.get_map():
                ready = selector.select(timeout)
                if not ready:
                    raise subprocess.TimeoutExpired(["train.py"], timeout)
                for key, _ in ready:
                    chunk = os.read(key.fd, 1 << 16)
                    output[key.fileobj] += chunk
                    if not chunk:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
        self.wait(timeout)
        return output[self.stdout], output[self.stderr]


class Preloader:
    """This process's preloader (started on first use), and the environment it runs with."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            cwd=ROOT, env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self.lock = threading.Lock()

    def start(
        self, argv: list[str], env: dict[str, str], netns: str | None, stdout: int, stderr: int
    ) -> ForkedProcess | None:
        """Fork `python <argv>` in network namespace `netns` (or the preloader's) writing to these
        ends (left open here); None if the preloader has ended (it found a thread running, or was
        killed)."""
        ours, theirs = socket.socketpair()
        with self.lock, open(os.devnull, "rb") as stdin:
            try:
                request = json.dumps([argv, str(ROOT), env, netns]).encode()
                fds = [stdin.fileno(), stdout, stderr, theirs.fileno()]
                socket.send_fds(self.control, [request], fds)
            except OSError:
                return None
            finally:
                theirs.close()
        started = ours.recv(STATUS.size, socket.MSG_WAITALL)
        if len(started) < STATUS.size:
            return None
        (pid,) = STATUS.unpack(started)
        return ForkedProcess(pid, ours)


PRELOADER: Preloader | None = None
# Variables a forked run may have other values of, in its os.environ (its /proc/<pid>/environ
# keeps the preloader's): the current test's name, which pytest sets, and those that only the
# run reads, long after its imports (the tests' faulty models, SLURM's commands, W&B's login,
# gloo's interface: getenv when a process group starts).
READ_AT_RUN_TIME = (
    "PYTEST_CURRENT_TEST",
    *("FAULT", "FAIL_RANK", "FAIL_AT_STEP", "BUSY_RANK", "PAUSE_IN_WORLD", "PAUSE_AT_STEP"),
    "SLURM_CONF",
    "WANDB_SILENT",
    "GLOO_SOCKET_IFNAME",
)


def without(env: dict[str, str], keys: tuple[str, ...]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key not in keys}


def forked_train(
    command: list[str],
    base: dict[str, str],
    env: dict[str, str],
    one_page: int | None,
    netns: str | None = None,
) -> ForkedProcess | None:
    """`command` (`python train.py ...`, or eval.py's or plan.py's) with environment `env`, in
    network namespace `netns` (if given; `ip netns add`'s), forked by this process's preloader of
    environment `base` (this process's, as the tests run it: started on first use, and again
    whenever `base` changes), its stdout and stderr to the write end `one_page` (left open here),
    or else to pipes of their own for `communicate`; None where it must run as a new process: a
    command with a prefix, an `env` that sets more than `READ_AT_RUN_TIME` over `base`,
    TEST_FORKS=0, or no preloader serving."""
    global PRELOADER
    if command[0] != sys.executable or command[1:2] not in (["train.py"], ["eval.py"], ["plan.py"]):
        return None
    if os.environ.get("TEST_FORKS") == "0":
        return None
    if without(env, READ_AT_RUN_TIME) != without(base, READ_AT_RUN_TIME):
        return None
    if PRELOADER is None or without(PRELOADER.env, READ_AT_RUN_TIME) != without(
        base, READ_AT_RUN_TIME
    ):
        # This process's own environment has changed since (code the tests run in-process sets
        # variables): a preloader of the new one; the old one ends once its runs have.
        if PRELOADER is not None:
            PRELOADER.control.close()
        PRELOADER = Preloader(base)
    if one_page is not None:
        return PRELOADER.start(command[1:], env, netns, one_page, one_page)
    (stdout, stdout_end), (stderr, stderr_end) = os.pipe(), os.pipe()
    process = PRELOADER.start(command[1:], env, netns, stdout_end, stderr_end)
    os.close(stdout_end), os.close(stderr_end)
    if process is None:
        os.close(stdout), os.close(stderr)
        return None
    process.stdout, process.stderr = os.fdopen(stdout, "rb"), os.fdopen(stderr, "rb")
    return process


def preload_and_serve(control_fd: int) -> list[str] | None:
    """In the preloader: import, then serve; in each child, its argv."""
    sys.path[0] = str(ROOT)
    import hydra  # noqa: F401
    import matplotlib.backends.backend_agg  # noqa: F401 - every sweep's report draws with it
    import matplotlib.figure  # noqa: F401 - (scaling.png): 0.3 s of CPU per sweep otherwise
    import wandb  # noqa: F401

    from src.config.schema import register_configs
    from src.runtime.forking import import_rank_modules

    import_rank_modules()  # torch._dynamo, the training code; a launcher's strategy's modules
    register_configs()  # every run's first step (0.025 s of CPU)

    # The imports' objects live as long as every run: out of the collector's reach, a run's
    # full collections skip them, and leave their pages shared
    # with the preloader rather than copying them (0.25 s of CPU a collection otherwise).
    gc.freeze()
    if len(os.listdir("/proc/self/task")) > 1:
        return None  # a fork of a threaded process could hang: runs go to new processes
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker's Ctrl-C is the worker's
    try:
        argv = serve(socket.socket(fileno=control_fd))
    except KeyboardInterrupt:
        return None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return argv


if __name__ == "__main__":
    child_argv = preload_and_serve(int(sys.argv[1]))
    if child_argv is not None:
        import runpy

        sys.argv = child_argv
        runpy.run_path(str(ROOT / child_argv[0]), run_name="__main__")
