"""Running as one rank of a multi-process job, whoever started it: torchrun, srun or `launch`.

The ranks are read from the environment (torchrun's variables, or SLURM's under `srun`). When
something else already started the ranks (`torchrun --nproc_per_node=N train.py ...`, or `srun`
with one task per device), every rank runs its own Hydra job and nothing is launched:
`follow_rank0_run_dir` (called by `train.py` before Hydra starts) makes the other ranks wait for
rank 0's run directory, so that `${now:...}` is resolved once and there is one run directory.
Every rank logs with its rank on every line, and `run_as_rank` runs its work, failing in order
(the first rank to fail is the one the launcher names).

torch is imported inside the functions that need it, so that `train.py --help` stays fast.
"""

from __future__ import annotations

import copy
import functools
import logging
import logging.config
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from src.launch.store_answers import STORE_ANSWER_S, answer_within
from src.runtime.progress import show_progress_here
from src.runtime.ranks import Ranks

log = logging.getLogger(__name__)

RUN_DIR_KEY = "template/run_dir"
FAILURES_KEY = "template/failures"
# A failing rank waits a moment before it exits, so that the launcher sees the rank that failed
# first (or that was killed without a word) exit first, and names it, rather than one of the
# ranks that failed after it because a peer went away. Later failures wait longer; the launcher
# stops them as soon as the first one has exited.
FIRST_FAILURE_WAIT_S = 1.0
LATER_FAILURE_WAIT_S = 3.0


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
    show_progress_here(ranks.rank == 0)
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
    return answer_within(STORE_ANSWER_S, lambda: int(rank_store().add(FAILURES_KEY, add)))
