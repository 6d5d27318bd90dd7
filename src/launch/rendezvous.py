"""The rendezvous of the jobs `launch` starts: torch's c10d rendezvous for a fixed set of nodes
that never restarts its ranks, asking the store nothing while they run.

torch's agent asks the rendezvous every `monitor_interval` (0.1 s) whether a node waits to join,
to restart its ranks with it. A `launch`ed job is as many nodes as it was started with and never
restarts, so the answer serves nothing; and the question is a store read, which on the far side of
a partition blocks the agent for the store's whole timeout (60 s), blind to its own ranks
failing. Leaving the rendezvous at the end is bounded the same way: it writes to that store.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)

from src.launch.store_answers import STORE_ANSWER_S, answer_within

BACKEND = "template-c10d"  # the name `launch_config` gives torch's agent


class FixedSizeRendezvous(RendezvousHandler):
    """torch's c10d rendezvous handler (`rendezvous`), but for `num_nodes_waiting`, which is
    always 0, and `shutdown`, which gives up after `leave_within_s`."""

    def __init__(self, rendezvous: RendezvousHandler, leave_within_s: float):
        self.rendezvous = rendezvous
        self.leave_within_s = leave_within_s

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self.rendezvous.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        return self.rendezvous.next_rendezvous()

    def is_closed(self) -> bool:
        return self.rendezvous.is_closed()

    def set_closed(self) -> None:
        self.rendezvous.set_closed()

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.rendezvous.get_run_id()

    def shutdown(self) -> bool:
        """Leave the rendezvous, or give up after `leave_within_s` (the store is out of reach):
        the other nodes then find the job over by their own ranks' failures."""
        return bool(answer_within(self.leave_within_s, self.rendezvous.shutdown))


def fixed_size_rendezvous(params: RendezvousParameters) -> FixedSizeRendezvous:
    """The handler for `BACKEND`: c10d's for these parameters, as a `FixedSizeRendezvous`."""
    c10d = RendezvousParameters(
        "c10d",
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        **params.config,
    )
    return FixedSizeRendezvous(rendezvous_handler_registry.create_handler(c10d), STORE_ANSWER_S)


rendezvous_handler_registry.register(BACKEND, fixed_size_rendezvous)
