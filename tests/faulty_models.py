"""A model for fault tests only, picked with `model._target_=tests.faulty_models.FaultyMLP`.

In its FAIL_AT_STEP-th training forward pass, on the rank named by FAIL_RANK, it raises
(FAULT=raise), kills its own process without a word (FAULT=kill), kills the rank server that
forked it (FAULT=kill_server) or the launcher above that (FAULT=kill_launcher), or stops forever
(FAULT=hang). The rank named by BUSY_RANK (if any) then keeps computing (a Python-level wait)
instead. Apart from FAULT, every rank of a world of PAUSE_IN_WORLD ranks waits for a signal
(`signal.pause`) in its PAUSE_AT_STEP-th forward pass in training mode of any FaultyMLP (the
checks on the meta device count), then goes on. Without FAULT or
PAUSE_IN_WORLD it is the MLP.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

from src.components.models import MLP

PAUSING_FORWARDS: list[FaultyMLP] = []


class FaultyMLP(MLP):
    def __init__(self, **sizes):
        super().__init__(**sizes)
        self.training_forwards = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        pausing_world = os.environ.get("PAUSE_IN_WORLD")
        if self.training and pausing_world and os.environ.get("WORLD_SIZE") == pausing_world:
            PAUSING_FORWARDS.append(self)  # counted over the process: its checks build models too
            if len(PAUSING_FORWARDS) == int(os.environ["PAUSE_AT_STEP"]):
                signal.pause()
        if self.training and "FAULT" in os.environ:
            self.training_forwards += 1
            rank = os.environ.get("RANK", "0")  # a process on its own is rank 0
            failing_rank = rank == os.environ["FAIL_RANK"]
            busy_rank = rank == os.environ.get("BUSY_RANK")
            at_step = self.training_forwards == int(os.environ["FAIL_AT_STEP"])
            if busy_rank and at_step:
                threading.Event().wait()
            if failing_rank and at_step:
                killed = {
                    "kill": os.getpid,
                    "kill_server": os.getppid,
                    "kill_launcher": lambda: parent_of(os.getppid()),
                }.get(os.environ["FAULT"])
                if killed is not None:
                    os.kill(killed(), signal.SIGKILL)
                    threading.Event().wait()  # until the kill's consequences reach this rank
                if os.environ["FAULT"] == "hang":
                    threading.Event().wait()
                raise RuntimeError(f"injected failure in training step {self.training_forwards}")
        return super().forward(inputs)


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])
