"""The rendezvous of the jobs `launch` starts: torch's c10d rendezvous, asking the store nothing
while the ranks run; for an elastic job (parallel.nodes=MIN:MAX), re-formed on the nodes left
when one is lost.

torch's agent asks the rendezvous every `monitor_interval` (0.1 s) whether a node waits to join,
to restart its ranks with it. A `launch`ed job takes in no node once started (but an elastic job
with parallel.rejoin), so the answer serves nothing; and the question is a store read, which on
the far side of a partition blocks the agent for the store's whole timeout (60 s), blind to its
own ranks failing. Leaving the rendezvous at the end is bounded the same way: it writes to that
store.

An elastic job's first round waits for all MAX nodes, as a fixed-size job's does; c10d's own
would start with the first MIN nodes in (after its last call). A round after a failure (the agent
restarts the ranks) is a second c10d rendezvous of the same store, for MIN to MAX nodes, whose
heartbeats find a lost node in seconds (`ELASTIC_SETTINGS`), where torch's defaults take 45 s.
A node that comes back once the job has re-formed joins that rendezvous' next round, with
parallel.rejoin: the others' agents stop their ranks (SIGTERM: they stop together after a step
and checkpoint) and restart them with it. Those ranks then exit without handing back a result
(`Rounds.restarting`): the agent reads none there, and would kill them after its fixed 30 s.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
    create_backend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from src.config.base import ConfigError
from src.launch.store_answers import STORE_ANSWER_S, answer_within

BACKEND = "template-c10d"  # the name `launch_config` gives torch's agent
ROUNDS_KEY = "rounds"  # in the rendezvous' configs: the job's `Rounds`, which are this module's
REJOIN_KEY = "rejoin"  # in the rendezvous' configs: parallel.rejoin, which is this module's
STARTED_KEY = "template/started"  # in the rendezvous' store: the job's first round formed
REFORMED_KEY = "template/reformed"  # in the rendezvous' store: a later round formed
RESUME_KEY = "template/resume"  # in a round's ranks' store: they go on with a re-formed job
NODE_KEY = "template/node/{}"  # in a round's store: the address of the node of that rank
RANKS_STORE_KEY = "template/ranks_store"  # in a round's store: its ranks' store, host:port
# An elastic job's c10d settings: a node whose heartbeat (every second) is missing 3 times is
# lost, and a round with enough nodes starts 1 s after the last came in.
ELASTIC_SETTINGS = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 1}


@dataclass
class Round:
    """One round of a job's rendezvous, as this node saw it: the nodes' addresses by node rank,
    this node's rank, when this node asked to join (its ranks had ended) and when the round was
    formed."""

    nodes: list[str]
    rank: int
    asked: float
    formed: float


def restart_event() -> Any:
    """An event this node's launcher shares with the ranks it starts (forked by its rank server,
    multiprocessing's forkserver, which takes the forkserver context's events only)."""
    return multiprocessing.get_context("forkserver").Event()


@dataclass
class Rounds:
    """The rounds of a job's rendezvous on this node; `reformed(before, now)` is called when a
    round after the first is formed, before the ranks restart. `restarting` is set while torch's
    agent stops this round's ranks to restart them with a node that joined: it reads no result
    of theirs then, so a rank that ends exits at once rather than wait for the agent's SIGKILL."""

    reformed: Callable[[Round, Round], None] | None = None
    seen: list[Round] = field(default_factory=list)
    restarting: Any = field(default_factory=restart_event)


class JobRunsWithout(ConfigError):
    """This node comes to an elastic job that runs already, without it, and may not join."""


class JobRendezvous(RendezvousHandler):
    """torch's c10d rendezvous handler `start` for the first round, `elastic` (None: the job
    never restarts) for the later ones, both on the rendezvous' `store`; `shutdown` gives up after
    `leave_within_s`. `num_nodes_waiting` is 0 but with `rejoin`, in a job re-formed already:
    then a node that comes back (its first round is `elastic`'s) restarts the job with it."""

    def __init__(
        self,
        start: RendezvousHandler,
        elastic: RendezvousHandler | None,
        store: Store,
        rounds: Rounds,
        address: str,
        rejoin: bool,
    ):
        self.start = start
        self.elastic = elastic
        self.store = store
        self.rounds = rounds
        self.address = address
        self.rejoin = rejoin
        self.leave_within_s = STORE_ANSWER_S
        self.in_use = start
        self.ranks_store: Store | None = None  # hosted here, for the ranks of this round

    def handlers(self) -> list[RendezvousHandler]:
        return [self.start] if self.elastic is None else [self.start, self.elastic]

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self.start.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        asked = time.time()
        self.rounds.restarting.clear()  # this round's ranks hand back their results
        seen = self.rounds.seen
        late = not seen and self.elastic is not None and self.store.check([STARTED_KEY])
        if late and not (self.rejoin and self.store.check([REFORMED_KEY])):
            raise JobRunsWithout(
                f"the job of rendezvous {self.start.get_run_id()} runs already, without this "
                "node: parallel.rejoin=true lets a node join it once it has lost one"
            )
        self.in_use = self.start if not (seen or late) or self.elastic is None else self.elastic
        info = self.in_use.next_rendezvous()
        self.store.set(STARTED_KEY if self.in_use is self.start else REFORMED_KEY, "1")
        if self.elastic is not None and info.rank == 0:
            self.host_ranks_store(info, resumes=self.in_use is self.elastic)
        info.store.set(NODE_KEY.format(info.rank), self.address)
        nodes = [info.store.get(NODE_KEY.format(rank)).decode() for rank in range(info.world_size)]
        seen.append(Round(nodes, info.rank, asked, time.time()))
        if len(seen) > 1 and self.rounds.reformed is not None:
            self.rounds.reformed(seen[-2], seen[-1])
        return info if self.elastic is None else with_ranks_store(info)

    def host_ranks_store(self, info: RendezvousInfo, resumes: bool) -> None:
        """On the node of rank 0 of an elastic job's round: a new store for the round's ranks,
        holding `RESUME_KEY` if they go on with a job re-formed (after a node lost or joined);
        its address in the round's store. c10d's handler keeps one store for all its rounds,
        and the keys that a round's ranks left there (the process group's addresses and barrier
        counts) would mislead the next."""
        self.ranks_store = TCPStore(self.address, 0, is_master=True, multi_tenant=True)
        if resumes:
            self.ranks_store.set(RESUME_KEY, "1")
        info.store.set(RANKS_STORE_KEY, f"{self.address}:{self.ranks_store.port}")
        # c10d's handler on a node that joins later waits for these in its next_rendezvous,
        # which the handler of rank 0 sets in its own first round only.
        info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, self.address)
        info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(self.ranks_store.port))

    def is_closed(self) -> bool:
        return any(handler.is_closed() for handler in self.handlers())

    def set_closed(self) -> None:
        for handler in self.handlers():
            handler.set_closed()

    def num_nodes_waiting(self) -> int:
        """Nodes that came back to the re-formed job, with `rejoin`; else 0, and the store is
        asked nothing (see the module's docstring)."""
        if not self.rejoin or self.in_use is not self.elastic:
            return 0
        waiting = answer_within(self.leave_within_s, self.elastic.num_nodes_waiting) or 0
        if waiting:  # torch's agent restarts the ranks now
            self.rounds.restarting.set()
        return waiting

    def get_run_id(self) -> str:
        return self.start.get_run_id()

    def shutdown(self) -> bool:
        """Leave the rendezvous, or give up after `leave_within_s` (the store is out of reach):
        the other nodes then find the job over by their own ranks' failures."""

        def leave() -> bool:
            return all([handler.shutdown() for handler in self.handlers()])

        return bool(answer_within(self.leave_within_s, leave))


def with_ranks_store(info: RendezvousInfo) -> RendezvousInfo:
    """`info`, its ranks' store the one that rank 0's node hosts for the round."""
    host, port = info.store.get(RANKS_STORE_KEY).decode().rsplit(":", 1)
    store_info = RendezvousStoreInfo(master_addr=host, master_port=int(port))
    return RendezvousInfo(info.store, info.rank, info.world_size, store_info)


def job_rendezvous(params: RendezvousParameters) -> JobRendezvous:
    """The handler for `BACKEND`: c10d's for these parameters (for all `max_nodes` at the start),
    as a `JobRendezvous`; elastic where `min_nodes` < `max_nodes`."""
    config = dict(params.config)
    rounds, rejoin = config.pop(ROUNDS_KEY, None) or Rounds(), config.pop(REJOIN_KEY, False)
    address = params.local_addr or socket.getfqdn()

    def c10d(run_id: str, min_nodes: int) -> RendezvousParameters:
        return RendezvousParameters(
            "c10d", params.endpoint, run_id, min_nodes, params.max_nodes, params.local_addr,
            **config,
        )  # fmt: skip

    elastic_params = c10d(params.run_id, params.min_nodes)
    backend, store = create_backend(elastic_params)
    if params.min_nodes == params.max_nodes:
        start = create_handler(store, backend, elastic_params)
        return JobRendezvous(start, None, store, rounds, address, rejoin)
    start_id = f"{params.run_id}-start"
    start_backend = C10dRendezvousBackend(store, start_id)
    start = create_handler(store, start_backend, c10d(start_id, params.max_nodes))
    elastic = create_handler(store, backend, elastic_params)
    return JobRendezvous(start, elastic, store, rounds, address, rejoin)


def rendezvous_configs(parallel: Any, elastic: bool, rounds: Rounds) -> dict[str, Any]:
    """What `launch_config` passes the rendezvous: its timeout, and for an elastic job the
    settings that find a lost node in seconds and parallel.rejoin; this node's `rounds` to
    fill."""
    configs: dict[str, Any] = {"timeout": int(parallel.timeout_s), ROUNDS_KEY: rounds}
    if not elastic:
        return configs
    return {**configs, **ELASTIC_SETTINGS, REJOIN_KEY: parallel.rejoin}


rendezvous_handler_registry.register(BACKEND, job_rendezvous)
