"""Start the processes of a multi-process strategy.

`python train.py parallel=ddp parallel.devices=4` runs one Hydra job. Inside it, `launch` starts
the ranks with PyTorch's elastic agent, as `torchrun --standalone` would: c10d rendezvous on a
port the OS picks (so jobs on one machine never collide), no restarts. The workers get the
resolved config and the run directory; they log to the job's `train.log` and console with their
rank on every line. Ranks that torchrun or srun started join the job instead
(`src/launch/as_rank.py`).

torch is imported inside the functions that need it, so that `train.py --help` stays fast.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import signal
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from types import FrameType
from typing import TYPE_CHECKING, Any

from src.config.parallel import NodeRange
from src.launch.as_rank import configure_logging, rank_store, run_as_rank, started_ranks
from src.runtime.forking import become_forked_child, start_rank_server
from src.runtime.progress import show_progress_here
from src.runtime.torch_private import (
    name_rendezvous_events_cheaply,
)

if TYPE_CHECKING:
    from src.launch.rendezvous import Rounds

log = logging.getLogger(__name__)

# torch's loggers that report a failed rank (with a traceback) and the SIGTERM to the others.
AGENT_FAILURE_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.multiprocessing.spawn",
)
AGENT_HANDLED_SIGNALS = "SIGHUP,SIGQUIT"  # torch's agent stops the ranks at once on these
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
    restarting: Any,
) -> Any:
    """Entry point of each launched process: `fn(*args, ranks, stop=...)` as its rank (the agent
    has set RANK, WORLD_SIZE, ...). Where the agent stopped it to restart it (`restarting`, the
    launcher's `Rounds.restarting`), it exits as it ends: the agent reads no result then."""
    become_forked_child(server_pid, launcher_environment)
    # Forked by a forkserver, the rank would start its own processes (DataLoader workers) through
    # a forkserver of its own too, which imports torch again (seconds): they start the platform's
    # way instead, as under torchrun.
    multiprocessing.set_start_method(None, force=True)
    ranks = started_ranks()
    configure_logging(job_logging, f"rank{ranks.rank}")
    show_progress_here(ranks.rank == 0)
    # Connect to the launcher's store now: a rank that fails later tells it (`failure_order`),
    # signals ask it whether the job is over (`job_failed`), and once the launcher has died, a
    # new connection would wait 30 minutes for it.
    rank_store()
    try:
        result = run_as_rank(ranks, fn, *args, ranks, outcomes=outcomes)
    except outcomes as error:
        result = Raised(error)  # torch's agent carries results back, and exceptions only as text
    if restarting.is_set():
        logging.shutdown()
        os._exit(0)
    return result


def launch(
    fn: Callable[..., Any],
    args: tuple,
    processes_per_node: int,
    nodes: int | NodeRange,
    parallel: Any,
    job_logging: dict[str, Any],
    outcomes: tuple[type, ...] = (),
    rounds: Rounds | None = None,
) -> Any:
    """Run `fn(*args, ranks, stop=...)` in `processes_per_node` new processes on this node (see
    `run_as_rank`); returns the result of the lowest rank here, or raises what it raised of
    `outcomes` (picklable exceptions that end a run as planned: every rank raises one alike).
    `parallel` gives master_addr/master_port, timeout_s and max_restarts; `rounds` collects the
    rendezvous' rounds on this node.

    A failure in any rank, or the death of the rank server that forked them, stops them all
    and raises `JobFailed`, naming the process that failed first (a rank logs its traceback);
    in an elastic job (`nodes` a range) only once parallel.max_restarts are spent: before, the
    job is re-formed on the nodes left and its ranks restart.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError
    from torch.distributed.launcher.api import elastic_launch

    from src.launch.rendezvous import Rounds

    rounds = rounds or Rounds()
    name_rendezvous_events_cheaply()
    # JobFailed's line says what these would.
    for name in AGENT_FAILURE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    span = node_span(nodes)
    with tempfile.TemporaryDirectory(prefix="torchelastic-") as error_dir:
        config = launch_config(processes_per_node, span, parallel, error_dir, rounds)
        with stop_signals_passed_to_ranks() as killing:
            worker = elastic_launch(config, _worker)
            server_pid = start_rank_server()
            try:
                results = worker(
                    fn, args, outcomes, job_logging, server_pid, dict(os.environ), rounds.restarting
                )
            except ChildFailedError as failed:
                if killing:  # the ranks died of it, but its exception was dropped
                    raise KilledBySignal(killing[0]) from None
                ended = first_to_die(failed, server_pid, processes_per_node, span.most)
                raise JobFailed(ended) from None
            except RendezvousConnectionError:
                if not rounds.seen:  # at the start: torch's own words say best what is wrong
                    raise
                raise JobFailed(cannot_reform(config.rdzv_endpoint)) from None
            if killing:
                raise KilledBySignal(killing[0])
    result = results[min(results)]
    if isinstance(result, Raised):
        raise result.error
    return result


def cannot_reform(endpoint: str) -> str:
    """Why an elastic job that lost a node ended instead of going on: its rendezvous is gone."""
    return (
        f"the job could not re-form on the nodes left: its rendezvous at {endpoint} is out of "
        "reach (the node of parallel.master_addr, which hosts it, is lost, or the network to it "
        "is down); an elastic job goes on without any node but that one"
    )


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


def launch_config(
    processes_per_node: int,
    nodes: int | NodeRange,
    parallel: Any,
    error_dir: str,
    rounds: Rounds | None = None,
) -> Any:
    """What `torchrun --standalone` would set up (or, on several nodes, a rendezvous at
    parallel.master_addr:master_port), with no restarts, or for an elastic job (`nodes` a range)
    parallel.max_restarts (`src/launch/rendezvous.py`); the ranks' error files in `error_dir`."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from src.launch.rendezvous import BACKEND, Rounds, rendezvous_configs

    span = node_span(nodes)
    rendezvous = rendezvous_configs(parallel, span.elastic, rounds or Rounds())
    node_address = None
    if span.most == 1 and parallel.master_port == 0:
        endpoint, run_id = "localhost:0", uuid.uuid4().hex
    else:
        # Every node's launcher must name the same rendezvous.
        endpoint = f"{parallel.master_addr}:{parallel.master_port}"
        run_id = f"train-{endpoint}"
        node_address, rendezvous["is_host"] = this_node(parallel.master_addr)
    log.info(
        "launching %d processes per node on %s node(s), rendezvous at %s",
        processes_per_node,
        f"{span.least} to {span.most}" if span.elastic else span.most,
        endpoint,
    )
    return LaunchConfig(
        min_nodes=span.least,
        max_nodes=span.most,
        nproc_per_node=processes_per_node,
        run_id=run_id,
        rdzv_backend=BACKEND,
        rdzv_endpoint=endpoint,
        rdzv_configs=rendezvous,
        local_addr=node_address,
        max_restarts=parallel.max_restarts if span.elastic else 0,
        start_method="forkserver",  # see `start_rank_server`
        logs_specs=DefaultLogsSpecs(log_dir=error_dir),
        signals_to_handle=AGENT_HANDLED_SIGNALS,
        **agent_shutdown_timeout(LaunchConfig, parallel.timeout_s),
    )


def node_span(nodes: int | NodeRange) -> NodeRange:
    """`nodes` as a range: a number of nodes is a job of fixed size."""
    return nodes if isinstance(nodes, NodeRange) else NodeRange(nodes, nodes)


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
