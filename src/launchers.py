"""The SLURM launcher behind `hydra/launcher=slurm`: hydra-submitit-launcher, sized per job.

hydra-submitit-launcher reads nodes, tasks and GPUs once per multirun, from the sweep's primary
config, where swept values such as `parallel.devices=1,2,4,8` do not appear. This launcher submits
each job on its own, sized from that job's config:

    nodes          parallel.nodes (1 for single-process strategies)
    gpus_per_node  parallel.devices / nodes (0 with trainer.accelerator=cpu)
    tasks_per_node the strategy's processes per node: one per GPU for ddp, one per data-parallel
                   replica for hybrid, 1 for single, dp and model_parallel, which drive several
                   GPUs from one process

The ranks of a multi-task job then come from SLURM's environment (see `parallel=ddp`). Jobs are
submitted together and waited for together, so they run as the cluster allows. A combination that
cannot run gets a one-task CPU allocation, only to record itself as skipped in the sweep's table.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from omegaconf import DictConfig

from src.strategies import build_strategy
from src.strategies.base import ConfigError

SKIP_RESOURCES = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0}


def slurm_resources(cfg: DictConfig) -> dict[str, int]:
    """The allocation one job needs: `nodes`, `tasks_per_node`, `gpus_per_node`."""
    parallel = cfg.parallel
    nodes = parallel.get("nodes", 1)
    if parallel.devices % nodes:
        raise ConfigError(
            f"parallel.devices={parallel.devices} does not split evenly over "
            f"parallel.nodes={nodes}; make devices a multiple of nodes"
        )
    # Built for CPU only to ask for its process layout: the submitting host may have no GPU.
    strategy = build_strategy(parallel, "cpu")
    uses_gpus = cfg.trainer.accelerator != "cpu"
    return {
        "nodes": nodes,
        "tasks_per_node": strategy.processes_per_node,
        "gpus_per_node": parallel.devices // nodes if uses_gpus else 0,
    }


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        sized = []
        for job_num, overrides in enumerate(job_overrides, start=initial_job_idx):
            job_cfg = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides)
            )
            try:
                resources = slurm_resources(job_cfg)
            except ConfigError:
                resources = SKIP_RESOURCES
            launcher = copy.copy(self)
            launcher.params = {**self.params, **resources}
            sized.append((launcher, overrides, job_num))
        # The plugin's launch submits and then waits; one thread per job submits them all at once.
        with ThreadPoolExecutor(max_workers=len(sized)) as pool:
            return list(pool.map(lambda job: launch_one(*job), sized))


def launch_one(launcher: SlurmLauncher, overrides: Sequence[str], job_num: int) -> JobReturn:
    (job_return,) = submitit_launcher.SlurmLauncher.launch(launcher, [overrides], job_num)
    return job_return
