"""Start the processes of a multi-process strategy, or join the ones torchrun or srun started.

`python train.py parallel=ddp parallel.devices=4` runs one Hydra job. Inside it, `launch` starts
the ranks with PyTorch's elastic agent, as `torchrun --standalone` would: c10d rendezvous on a
port the OS picks (so jobs on one machine never collide), no restarts. The workers get the
resolved config and the run directory; they log to the job's `train.log` and console with their
rank on every line.

When something else already started the ranks (`torchrun --nproc_per_node=N train.py ...`, or
`srun` with one task per device), every rank runs its own Hydra job and nothing is launched.
`follow_rank0_run_dir` (called by `train.py` before Hydra starts) makes the other ranks wait
for rank 0's run directory, so that `${now:...}` is resolved once and there is one run directory.

torch is imported inside the functions that need it, so that `train.py --help` stays fast.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import functools
import logging
import logging.config
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from types import FrameType
from typing import Any

from src.runtime.ranks import Ranks
from src.runtime.torch_private import (
    forkserver_forked_from_this_process,
    name_rendezvous_events_cheaply,
    rank_server_pid,
)

log = logging.getLogger(__name__)

RUN_DIR_KEY = "template/run_dir"
FAILURES_KEY = "template/failures"
# A failing rank waits a moment before it exits, so that the launcher sees the rank that failed
# first (or that was killed without a word) exit first, and names it, rather than one of the
# ranks that failed after it because a peer went away. Later failures wait longer; the launcher
# stops them as soon as the first one has exited.
FIRST_FAILURE_WAIT_S = 1.0
LATER_FAILURE_WAIT_S = 3.0
# torch's loggers that report a failed rank (with a traceback) and the SIGTERM to the others.
AGENT_FAILURE_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.multiprocessing.spawn",
)
AGENT_HANDLED_SIGNALS = "SIGHUP,SIGQUIT"  # torch's agent stops the ranks at once on these
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# A gloo collective that gave up after parallel.timeout_s, in the error it raises.
GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation to complete")


class KilledBySignal(BaseException):
    """`launch` stopped its ranks at once: a second SIGINT/SIGTERM, or one before they started.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` in torch's agent
    stops it on its way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class JobFailed(Exception):
    """A process of a job that `launch` started died or failed; the message names it."""


def adopt_slurm_environment() -> None:
    """Under `srun` with several tasks, set torchrun's variables from SLURM's.

    MASTER_ADDR defaults to the first node of the step and MASTER_PORT to a port derived from
    the job id, unless they are exported already (the usual sbatch recipe).
    """
    env = os.environ
    if "RANK" in env or int(env.get("SLURM_NTASKS", "1")) < 2 or "SLURM_PROCID" not in env:
        return
    world_size = int(env["SLURM_NTASKS"])
    nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
    nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = str(world_size)
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = str(world_size // nodes)  # srun spreads tasks evenly
    env.setdefault("MASTER_ADDR", first_node(nodelist))
    env.setdefault("MASTER_PORT", str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))


def first_node(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    match = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist)
    if match is None:
        raise ValueError(f"cannot read the first node of SLURM node list {nodelist!r}")
    return match.group(1) + (match.group(2) or "")


def started_ranks() -> Ranks | None:
    """The ranks torchrun, srun or `launch` started, or None when this process is the only one."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world_size = int(env["WORLD_SIZE"])
    return Ranks(
        rank=int(env["RANK"]),
        world_size=world_size,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world_size))),
    )


@functools.cache
def rank_store() -> Any:
    """This process's connection to the job's key-value store (`env://`, as the process group's).

    Under torchrun the agent hosts the store; under srun rank 0 hosts it, and the process group
    later shares the same server. Cached: the connection (and rank 0's server) lives as long as
    the process.
    """
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://"))
    return store


def follow_rank0_run_dir() -> None:
    """Before Hydra starts: on ranks other than 0, use rank 0's run directory.

    Rank 0 composes its config and publishes its run directory (`join_started_ranks`); the other
    ranks wait for it and run their Hydra job in it, without rewriting its `.hydra/` files.
    """
    adopt_slurm_environment()
    ranks = started_ranks()
    if ranks is None or ranks.world_size == 1:
        return
    if {"-m", "--multirun"} & set(sys.argv):
        sys.exit("train.py: sweeps (-m) cannot run inside torchrun/srun; launch them without it")
    store = rank_store()  # on rank 0 under srun: the server, which dies with it if it fails
    if ranks.rank != 0:
        run_dir = store.get(RUN_DIR_KEY).decode()
        sys.argv += [f"hydra.run.dir={run_dir}", "hydra.output_subdir=null"]


def join_started_ranks(ranks: Ranks, run_dir: str, job_logging: dict[str, Any]) -> None:
    """Inside the Hydra job of a rank started by torchrun/srun: tag its log lines with its rank;
    rank 0 tells the others where the run directory is (see `follow_rank0_run_dir`)."""
    configure_logging(job_logging, f"rank{ranks.rank}")
    if ranks.rank == 0 and ranks.world_size > 1:
        rank_store().set(RUN_DIR_KEY, run_dir)


def configure_logging(job_logging: dict[str, Any], label: str) -> None:
    """Hydra's logging setup (console and the run's `train.log`), every line tagged `[label]`."""
    config = copy.deepcopy(job_logging)
    for formatter in config.get("formatters", {}).values():
        if "format" in formatter:
            formatter["format"] = f"[{label}]{formatter['format']}"
    logging.config.dictConfig(config)


def run_as_rank(
    ranks: Ranks, fn: Callable[..., Any], *args: Any, outcomes: tuple[type, ...] = ()
) -> Any:
    """`fn(*args, stop=...)` as one rank of a multi-process job. From now to its exit, SIGINT
    and SIGTERM only ask `fn` to stop with the other ranks (`stop`, a `StopOnSignal` that `fn`
    must watch), unless the job is over (a rank failed, or the launcher died): then the rank
    exits. An exception in `outcomes` is how the run ended (every rank raises it alike); any
    other is a failure: logged, and the rank leaves in order (see `failure_order`)."""
    from src.runtime.stopping import StopOnSignal

    stop = StopOnSignal(False, job_failed=lambda: job_failed(ranks)).__enter__()
    try:
        return fn(*args, stop=stop)
    except outcomes:
        raise
    except Exception:
        log.exception("failed")
        if ranks.world_size > 1:
            wait = FIRST_FAILURE_WAIT_S if failure_order() == 1 else LATER_FAILURE_WAIT_S
            time.sleep(wait)
        raise


def job_failed(ranks: Ranks) -> bool:
    """Whether a rank has reported a failure, or the store has died with the launcher (or the
    rank 0) that hosted it: either way the job is over."""
    if ranks.world_size == 1:
        return False
    failures = reported_failures(add=0)
    return failures is None or failures > 0


def failure_order() -> int:
    """1 for the first rank of the job to report a failure, 2 for the next, ..."""
    return reported_failures(add=1) or 1


def reported_failures(add: int) -> int | None:
    """The job's count of failed ranks after adding `add`; None if the store is gone (it dies
    with the launcher, or under srun with rank 0) or out of reach (a lost node, a partition)."""
    from src.launch.rendezvous import STORE_ANSWER_S, answer_within

    return answer_within(STORE_ANSWER_S, lambda: int(rank_store().add(FAILURES_KEY, add)))


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


def start_rank_server_early(parallel: Any) -> None:
    """Start the rank server before this process imports torch, when its settings say that ranks
    will be launched here: a strategy of one process per replica (`DistributedConfig`'s
    settings) on more than one device, outside torchrun and srun. The server's imports, torch's
    and the training code's, then overlap this process's own instead of following them (measured by
    `scripts/benchmark.py --only startup`). It is a guess from the settings alone, the
    strategy not being built yet: `launch` starts the server anyway if it is not running, and a
    server started for a job that turns out to run one process (hybrid with devices == stages)
    only imported for nothing."""
    from omegaconf import OmegaConf

    from src.config.parallel import DistributedConfig

    distributed = issubclass(OmegaConf.get_type(parallel) or object, DistributedConfig)
    if distributed and parallel.devices * parallel.nodes > 1 and started_ranks() is None:
        start_rank_server()


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


@dataclass
class Raised:
    """How a launched rank hands the launcher an exception of `outcomes` (see `launch`)."""

    error: BaseException


def _worker(
    fn: Callable[..., Any],
    args: tuple,
    outcomes: tuple[type, ...],
    job_logging: dict[str, Any],
    server_pid: int | None,
    launcher_environment: dict[str, str],
) -> Any:
    """Entry point of each launched process: `fn(*args, ranks, stop=...)` as its rank (the agent
    has set RANK, WORLD_SIZE, ...)."""
    end_with_launcher(server_pid)
    take_launcher_environment(launcher_environment)
    # The server ignores SIGTERM (`src.launch.rank_server`).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Forked by a forkserver, the rank would start its own processes (DataLoader workers) through
    # a forkserver of its own too, which imports torch again (seconds): they start the platform's
    # way instead, as under torchrun.
    multiprocessing.set_start_method(None, force=True)
    ranks = started_ranks()
    configure_logging(job_logging, f"rank{ranks.rank}")
    # Connect to the launcher's store now: a rank that fails later tells it (`failure_order`),
    # signals ask it whether the job is over (`job_failed`), and once the launcher has died, a
    # new connection would wait 30 minutes for it.
    rank_store()
    try:
        return run_as_rank(ranks, fn, *args, ranks, outcomes=outcomes)
    except outcomes as error:
        return Raised(error)  # torch's agent carries results back, and exceptions only as text


def launch(
    fn: Callable[..., Any],
    args: tuple,
    processes_per_node: int,
    nodes: int,
    parallel: Any,
    job_logging: dict[str, Any],
    outcomes: tuple[type, ...] = (),
) -> Any:
    """Run `fn(*args, ranks, stop=...)` in `processes_per_node` new processes on this node (see
    `run_as_rank`); returns the result of the lowest rank here, or raises what it raised of
    `outcomes` (picklable exceptions that end a run as planned: every rank raises one alike).
    `parallel` gives master_addr/master_port and timeout_s.

    A failure in any rank, or the death of the rank server that forked them, stops them all
    and raises `JobFailed`, naming the process that failed first (a rank logs its traceback).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    name_rendezvous_events_cheaply()
    # JobFailed's line says what these would.
    for name in AGENT_FAILURE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="torchelastic-") as error_dir:
        config = launch_config(processes_per_node, nodes, parallel, error_dir)
        with stop_signals_passed_to_ranks() as killing:
            worker = elastic_launch(config, _worker)
            server_pid = start_rank_server()
            try:
                results = worker(fn, args, outcomes, job_logging, server_pid, dict(os.environ))
            except ChildFailedError as failed:
                if killing:  # the ranks died of it, but its exception was dropped
                    raise KilledBySignal(killing[0]) from None
                ended = first_to_die(failed, server_pid, processes_per_node, nodes)
                raise JobFailed(ended) from None
            if killing:
                raise KilledBySignal(killing[0])
    result = results[min(results)]
    if isinstance(result, Raised):
        raise result.error
    return result


def first_to_die(failed: Any, server_pid: int | None, processes_per_node: int, nodes: int) -> str:
    """Which process of the job ended it, from torch's `ChildFailedError`: the rank server if
    it has died (its ranks die with it, and the agent sees them exit 255, with no cause), or
    else the rank that failed first, with its error or the signal that killed it (a collective
    that timed out named as such, with the peers it waited for)."""
    server_end = child_end(server_pid) if server_pid is not None else None
    if server_end is not None:
        return f"the rank server (pid {server_pid}), which forks the ranks, {server_end}"
    rank, failure = failed.get_first_failure()
    if failure.exitcode < 0:
        return f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}"
    message = failure.message  # what the rank's error file holds: its exception, or a dict
    text = message.get("message", "") if isinstance(message, dict) else str(message)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # A wrapped error ("...Failed: backend='inductor' raised:") names its cause on the next line.
    line = " ".join(lines[:2] if lines[:1] and lines[0].endswith(":") else lines[:1])
    line = line or f"exit code {failure.exitcode}"
    timed_out = GLOO_TIMEOUT.search(line)
    if timed_out:
        peers = peers_of(rank, processes_per_node, nodes)
        line = (
            f"a collective timed out after {int(timed_out[1]) / 1000:g} s (parallel.timeout_s) "
            f"waiting for {peers}, which stopped answering: it hung or died, or the network to "
            f"it is down (gloo: {timed_out[0]})"
        )
    return f"rank {rank} (pid {failure.pid}) failed: {line} (its traceback is in train.log)"


def peers_of(rank: int, processes_per_node: int, nodes: int) -> str:
    """The ranks a collective of `rank` may have waited for: on several nodes those of the other
    nodes (a lost node or a partition cuts off all of a node's ranks; torch numbers the ranks node
    by node), on one node the others; with their nodes, counted from 1."""
    node = rank // processes_per_node
    peers = [
        peer
        for peer in range(processes_per_node * nodes)
        if peer != rank and (nodes == 1 or peer // processes_per_node != node)
    ]
    ranks = f"rank {peers[0]}" if len(peers) == 1 else f"ranks {', '.join(map(str, peers))}"
    if nodes == 1:
        return ranks
    their_nodes = sorted({peer // processes_per_node + 1 for peer in peers})
    named = "node" if len(their_nodes) == 1 else "nodes"
    return f"{ranks} ({named} {', '.join(map(str, their_nodes))} of {nodes})"


def child_end(pid: int) -> str | None:
    """How this process's child `pid` ended, or None while it runs; it stays unreaped, for
    multiprocessing to reap (a sweep's next job starts a new rank server)."""
    try:
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already
        return "died"
    if ended is None:
        return None
    if ended.si_code == os.CLD_EXITED:
        return f"exited with status {ended.si_status}"
    return f"was killed by {signal.Signals(ended.si_status).name}"


def launch_config(processes_per_node: int, nodes: int, parallel: Any, error_dir: str) -> Any:
    """What `torchrun --standalone` would set up (or, on several nodes, a rendezvous at
    parallel.master_addr:master_port), with no restarts; the ranks' error files in `error_dir`."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from src.launch.rendezvous import BACKEND

    rendezvous: dict[str, Any] = {"timeout": int(parallel.timeout_s)}
    node_address = None
    if nodes == 1 and parallel.master_port == 0:
        endpoint, run_id = "localhost:0", uuid.uuid4().hex
    else:
        # Every node's launcher must name the same rendezvous.
        endpoint = f"{parallel.master_addr}:{parallel.master_port}"
        run_id = f"train-{endpoint}"
        node_address, rendezvous["is_host"] = this_node(parallel.master_addr)
    log.info(
        "launching %d processes per node on %d node(s), rendezvous at %s",
        processes_per_node,
        nodes,
        endpoint,
    )
    return LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=processes_per_node,
        run_id=run_id,
        rdzv_backend=BACKEND,
        rdzv_endpoint=endpoint,
        rdzv_configs=rendezvous,
        local_addr=node_address,
        max_restarts=0,
        start_method="forkserver",  # see `start_rank_server`
        logs_specs=DefaultLogsSpecs(log_dir=error_dir),
        signals_to_handle=AGENT_HANDLED_SIGNALS,
        **agent_shutdown_timeout(LaunchConfig, parallel.timeout_s),
    )


def agent_shutdown_timeout(launch_config_class: type, timeout_s: float) -> dict[str, int]:
    """How long the ranks get to exit, once torch's agent has passed them one of its own signals
    (`AGENT_HANDLED_SIGNALS`), before SIGKILL: `parallel.timeout_s`, as a rank stuck in a
    collective could not answer sooner. torch 2.13 added LaunchConfig's `shutdown_timeout`;
    before, the agent gives them its fixed 30 s there, as every version does once a rank fails."""
    names = {field.name for field in fields(launch_config_class)}
    return {"shutdown_timeout": max(1, int(timeout_s))} if "shutdown_timeout" in names else {}


def this_node(master_addr: str) -> tuple[str | None, bool | None]:
    """This node's address towards the first node (`master_addr`), and whether this node hosts
    the rendezvous: True where the address is this node's own but torch's guess, which goes by
    the host name, misses it (nodes that share a host name, as containers and network namespaces
    do, or whose name resolves to a loopback address); None, torch's guess, otherwise. With its
    own guess torch lets a second launcher on the host join instead, as on a loopback
    master_addr (nodes on one host)."""
    import ipaddress
    import socket

    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    try:
        address = socket.gethostbyname(master_addr)
        if ipaddress.ip_address(address).is_loopback:
            return None, None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # UDP: picks the route, sends nothing
            own = probe.getsockname()[0]
    except OSError:  # no address or no route: the rendezvous will say so in its own words
        return None, None
    return own, (own == address and not _matches_machine_hostname(address)) or None


@contextlib.contextmanager
def stop_signals_passed_to_ranks() -> Iterator[list[int]]:
    """While the ranks run, pass a SIGINT/SIGTERM to this process on to them, and keep waiting
    for their results: they stop together and checkpoint, and hand back the stop as their
    outcome (see `src/runtime/stopping.py`). A second signal kills them at once and raises
    `KilledBySignal`; it is also kept in the list yielded, since Python drops an exception that
    a signal handler raises while a weakref callback or `__del__` runs (seen: the agent's).

    torch's agent would instead stop collecting the ranks' results and wait for them to exit,
    which they cannot do until their results are read: `launch` tells it to leave these signals
    alone (`AGENT_HANDLED_SIGNALS`).
    """

    from src.runtime.stopping import StopOnSignal, warn_from_signal_handler

    received: list[int] = []
    killing: list[int] = []

    def pass_on(signum: int, frame: FrameType | None) -> None:
        ranks = multiprocessing.active_children()
        name = signal.Signals(signum).name
        if received or not ranks:
            killing.append(signum)
            for rank in ranks:
                rank.kill()
            raise KilledBySignal(signum)
        received.append(signum)
        warn_from_signal_handler(
            log,
            "%s received: the ranks stop together at the next step they log, evaluate or "
            "checkpoint (send it again to stop them at once)",
            name,
        )
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                os.kill(rank.pid, signum)

    previous = {signum: signal.signal(signum, pass_on) for signum in StopOnSignal.SIGNALS}
    try:
        yield killing
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
