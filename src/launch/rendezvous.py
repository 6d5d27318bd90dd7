"""The rendezvous of the jobs `launch` starts: torch's c10d rendezvous, asking the store nothing
while the ranks run; for an elastic job (parallel.nodes=MIN:MAX), re-formed on the nodes left
when one is lost.

torch's agent asks the rendezvous every `monitor_interval` (0.1 s) whether a node waits to join,
to restart its ranks with it. A `launch`ed job never takes in a node once started, so the answer
serves nothing; and the question is a store read, which on the far side of a partition blocks the
agent for the store's whole timeout (60 s), blind to its own ranks failing. Leaving the rendezvous
at the end is bounded the same way: it writes to that store.

An elastic job's first round waits for all MAX nodes, as a fixed-size job's does; c10d's own
would start with the first MIN nodes in (after its last call). A round after a failure (the agent
restarts the ranks) is a second c10d rendezvous of the same store, for MIN to MAX nodes, whose
heartbeats find a lost node in seconds (`ELASTIC_SETTINGS`), where torch's defaults take 45 s.
"""

from __future__ import annotations

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

from src.launch.store_answers import STORE_ANSWER_S, answer_within

BACKEND = "template-c10d"  # the name `launch_config` gives torch's agent
ROUNDS_KEY = "rounds"  # in the rendezvous' configs: the job's `Rounds`, which are this module's
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


@dataclass
class Rounds:
    """The rounds of a job's rendezvous on this node; `reformed(before, now)` is called when a
    round after the first is formed, before the ranks restart."""

    reformed: Callable[[Round, Round], None] | None = None
    seen: list[Round] = field(default_factory=list)


class JobRendezvous(RendezvousHandler):
    """torch's c10d rendezvous handler `start` for the first round, `elastic` (None: the job
    never restarts) for the later ones; `num_nodes_waiting` is always 0, and `shutdown` gives
    up after `leave_within_s`."""

    def __init__(
        self,
        start: RendezvousHandler,
        elastic: RendezvousHandler | None,
        rounds: Rounds,
        address: str,
        leave_within_s: float,
    ):
        self.start = start
        self.elastic = elastic
        self.rounds = rounds
        self.address = address
        self.leave_within_s = leave_within_s
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
        seen = self.rounds.seen
        handler = self.start if not seen or self.elastic is None else self.elastic
        info = handler.next_rendezvous()
        info.store.set(NODE_KEY.format(info.rank), self.address)
        nodes = [info.store.get(NODE_KEY.format(rank)).decode() for rank in range(info.world_size)]
        seen.append(Round(nodes, info.rank, asked, time.time()))
        if len(seen) > 1 and self.rounds.reformed is not None:
            self.rounds.reformed(seen[-2], seen[-1])
        return info if self.elastic is None else self.with_new_ranks_store(info)

    def with_new_ranks_store(self, info: RendezvousInfo) -> RendezvousInfo:
        """`info`, its ranks' store (MASTER_ADDR:MASTER_PORT) a new one, hosted by the node of
        rank 0. c10d's handler keeps one for all its rounds, and the keys that a round's ranks
        left there (the process group's addresses and barrier counts) would mislead the next."""
        if info.rank == 0:
            self.ranks_store = TCPStore(self.address, 0, is_master=True, multi_tenant=True)
            info.store.set(RANKS_STORE_KEY, f"{self.address}:{self.ranks_store.port}")
        host, port = info.store.get(RANKS_STORE_KEY).decode().rsplit(":", 1)
        store_info = RendezvousStoreInfo(master_addr=host, master_port=int(port))
        return RendezvousInfo(info.store, info.rank, info.world_size, store_info)

    def is_closed(self) -> bool:
        return any(handler.is_closed() for handler in self.handlers())

    def set_closed(self) -> None:
        for handler in self.handlers():
            handler.set_closed()

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.start.get_run_id()

    def shutdown(self) -> bool:
        """Leave the rendezvous, or give up after `leave_within_s` (the store is out of reach):
        the other nodes then find the job over by their own ranks' failures."""

        def leave() -> bool:
            return all([handler.shutdown() for handler in self.handlers()])

        return bool(answer_within(self.leave_within_s, leave))


def job_rendezvous(params: RendezvousParameters) -> JobRendezvous:
    """The handler for `BACKEND`: c10d's for these parameters (for all `max_nodes` at the start),
    as a `JobRendezvous`; elastic where `min_nodes` < `max_nodes`."""
    config = dict(params.config)
    rounds = config.pop(ROUNDS_KEY, None) or Rounds()
    address = params.local_addr or socket.getfqdn()

    def c10d(run_id: str, min_nodes: int) -> RendezvousParameters:
        return RendezvousParameters(
            "c10d", params.endpoint, run_id, min_nodes, params.max_nodes, params.local_addr,
            **config,
        )  # fmt: skip

    if params.min_nodes == params.max_nodes:
        start = rendezvous_handler_registry.create_handler(c10d(params.run_id, params.max_nodes))
        return JobRendezvous(start, None, rounds, address, STORE_ANSWER_S)
    elastic_params = c10d(params.run_id, params.min_nodes)
    backend, store = create_backend(elastic_params)
    start_id = f"{params.run_id}-start"
    start_backend = C10dRendezvousBackend(store, start_id)
    start = create_handler(store, start_backend, c10d(start_id, params.max_nodes))
    elastic = create_handler(store, backend, elastic_params)
    return JobRendezvous(start, elastic, rounds, address, STORE_ANSWER_S)


def rendezvous_configs(parallel: Any, elastic: bool, rounds: Rounds) -> dict[str, Any]:
    """What `launch_config` passes the rendezvous: its timeout, and for an elastic job the
    settings that find a lost node in seconds; this node's `rounds` to fill."""
    configs: dict[str, Any] = {"timeout": int(parallel.timeout_s), ROUNDS_KEY: rounds}
    return {**configs, **ELASTIC_SETTINGS} if elastic else configs


rendezvous_handler_registry.register(BACKEND, job_rendezvous)
