"""Several jobs of a multirun at once on this machine, each on devices of its own
(`hydra/launcher=concurrent`, whose launcher in hydra_plugins/parallel_training calls `launch`).

Each job gets `parallel.devices` devices that no other running job has: GPUs (as its
`CUDA_VISIBLE_DEVICES`) when it trains on CUDA, CPU cores (as its CPU affinity, which its threads
and ranks inherit) otherwise. Jobs start in sweep order, each as soon as enough of its devices
are free (and fewer than `n_jobs` jobs run, if set); a job that asks for more devices than the
machine has gets them all, and its own checks say whether it can run. Each job runs in a process
of its own, started afresh (spawn), since a process that has used CUDA cannot change the GPUs it
sees, and threads that exist keep their affinity.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class Job:
    """A job of the sweep, and the devices it takes."""

    num: int
    overrides: Sequence[str]
    kind: str  # "cuda" or "cpu": which devices it takes
    count: int  # how many


def launch(
    n_jobs: int,
    hydra_context: HydraContext,
    task_function: TaskFunction,
    config: DictConfig,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
) -> list[JobReturn]:
    """`ConcurrentLauncher.launch`: the jobs' returns in job order."""
    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    pools = device_pools()
    jobs = []
    for index, overrides in enumerate(job_overrides):
        cfg = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        kind = "cuda" if cfg.trainer.accelerator != "cpu" and pools["cuda"] else "cpu"
        count = max(1, min(cfg.parallel.devices, len(pools[kind])))
        jobs.append(Job(initial_job_idx + index, overrides, kind, count))
    log.info("Launching %d jobs on %s", len(jobs), describe(pools))
    state = Singleton.get_state()

    def job_call(job: Job) -> Callable[[], JobReturn]:
        return functools.partial(execute_job, job, hydra_context, config, task_function, state)

    returns = schedule(jobs, pools, n_jobs if n_jobs > 0 else len(jobs), job_call)
    return [returns[job.num] for job in jobs]


def device_pools() -> dict[str, list[Any]]:
    """This process's GPUs, as a job's CUDA_VISIBLE_DEVICES is to name them (this process's own
    names if it is set: indices, or the UUIDs that container runtimes and MIG give), and cores."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda": [], "cpu": sorted(os.sched_getaffinity(0))}
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [name.strip() for name in visible.split(",")] if visible else range(count)
    # CUDA uses the names up to the first it cannot: as many as it counts.
    gpus = [str(name) for name in names][:count]
    return {"cuda": gpus, "cpu": sorted(os.sched_getaffinity(0))}


def describe(pools: dict[str, list[Any]]) -> str:
    gpus = f"GPUs {pools['cuda']} and " if pools["cuda"] else ""
    return f"{gpus}cores {pools['cpu']}"


def schedule(
    jobs: list[Job],
    pools: dict[str, list[Any]],
    at_once: int,
    job_call: Callable[[Job], Callable[[], JobReturn]],
) -> dict[int, JobReturn]:
    """Run the jobs in order, each as soon as its devices are free, each in a new process."""
    free = {kind: list(devices) for kind, devices in pools.items()}
    waiting, running, returns = deque(jobs), {}, {}
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(at_once, mp_context=spawn, max_tasks_per_child=1) as executor:
        while waiting or running:
            while waiting and len(running) < at_once and fits(waiting[0], free):
                job = waiting.popleft()
                devices, free[job.kind] = free[job.kind][: job.count], free[job.kind][job.count :]
                names = "GPUs" if job.kind == "cuda" else "cores"
                overrides = " ".join(filter_overrides(job.overrides))
                log.info("\t#%d : %s (on %s %s)", job.num, overrides, names, devices)
                payload = cloudpickle.dumps(job_call(job))
                future: Future = executor.submit(run_on_devices, job.kind, devices, payload)
                running[future] = job, devices
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                job, devices = running.pop(future)
                back = {*free[job.kind], *devices}  # in the pool's order
                free[job.kind] = [device for device in pools[job.kind] if device in back]
                returns[job.num] = cloudpickle.loads(future.result())
    return returns


def fits(job: Job, free: dict[str, list[Any]]) -> bool:
    return len(free[job.kind]) >= job.count


def run_on_devices(kind: str, devices: list[Any], payload: bytes) -> bytes:
    """In a job's own process: take its devices, run it, return its JobReturn pickled (by
    cloudpickle, as the job was: the config holds classes of modules that Hydra loaded outside
    `sys.modules`)."""
    if kind == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    else:
        os.sched_setaffinity(0, devices)
    return cloudpickle.dumps(cloudpickle.loads(payload)())


def execute_job(
    job: Job,
    hydra_context: HydraContext,
    config: DictConfig,
    task_function: TaskFunction,
    singleton_state: dict[Any, Any],
) -> JobReturn:
    """One Hydra job, as hydra-joblib-launcher runs it in its worker processes."""
    setup_globals()
    Singleton.set_state(singleton_state)
    sweep_config = hydra_context.config_loader.load_sweep_config(config, list(job.overrides))
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{job.num}"
        sweep_config.hydra.job.num = job.num
    HydraConfig.instance().set_config(sweep_config)
    return run_job(
        hydra_context=hydra_context,
        config=sweep_config,
        task_function=task_function,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
