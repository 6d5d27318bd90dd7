"""The SLURM launcher behind `hydra/launcher=slurm`: hydra-submitit-launcher, sized per job.

(Hydra takes launchers only from the `hydra_plugins` package, hence this file's place; Hydra
imports it at every start, so everything heavy is imported where it is used.)

hydra-submitit-launcher reads nodes, tasks and GPUs once per multirun, from the sweep's primary
config, where swept values such as `parallel.devices=1,2,4,8` do not appear. This launcher submits
each job on its own, sized from that job's config:

    nodes          parallel.nodes
    gpus_per_node  parallel.devices (none asked for with trainer.accelerator=cpu)
    tasks_per_node the strategy's processes per node: one per GPU for ddp, 1 for single, dp and
                   model_parallel, which drive all their GPUs from one process

In each task, the ranks come from SLURM's environment (`src.launch.adopt_slurm_environment`, as
under a plain `srun train.py`), so a ddp job joins the ranks SLURM started instead of launching
its own. Jobs are submitted together and waited for together, so they run as the cluster allows.
A combination that cannot run gets a one-task allocation without GPUs, only to record itself as
skipped.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from omegaconf import DictConfig


def slurm_resources(cfg: DictConfig) -> dict[str, int | None]:
    """The allocation one job needs: `nodes`, `tasks_per_node`, `gpus_per_node`."""
    from src.strategies import build_strategy
    from src.strategies.base import ConfigError

    try:
        # Built for CPU only to ask for its process layout: the submitting host may have no GPU.
        strategy = build_strategy(cfg.parallel, "cpu")
    except ConfigError:
        return {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": None}  # runs only to say why not
    uses_gpus = cfg.trainer.accelerator != "cpu"
    return {
        "nodes": cfg.parallel.nodes,
        "tasks_per_node": strategy.processes_per_node,
        "gpus_per_node": cfg.parallel.devices if uses_gpus else None,
    }


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """One SLURM task of a job: runs its Hydra job as one of the job's ranks."""
        from src.launch import adopt_slurm_environment

        adopt_slurm_environment()
        return super().__call__(*args, **kwargs)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        sized = []
        for job_num, overrides in enumerate(job_overrides, start=initial_job_idx):
            job_cfg = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides)
            )
            launcher = copy.copy(self)
            launcher.params = {**self.params, **slurm_resources(job_cfg)}
            sized.append((launcher, overrides, job_num))
        # The plugin's launch submits and then waits; one thread per job submits them all at once.
        with ThreadPoolExecutor(max_workers=len(sized)) as pool:
            return list(pool.map(lambda job: launch_one(*job), sized))


def launch_one(launcher: SlurmLauncher, overrides: Sequence[str], job_num: int) -> JobReturn:
    (job_return,) = submitit_launcher.SlurmLauncher.launch(launcher, [overrides], job_num)
    return job_return
