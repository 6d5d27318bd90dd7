"""The launcher behind `hydra/launcher=concurrent`: several jobs of a multirun at once on this
machine, each on devices of its own (see src/launch/concurrent_jobs.py).

(Hydra takes launchers only from the `hydra_plugins` package, hence this file's place; Hydra
loads it at every start, outside `sys.modules`, so the work happens in
src/launch/concurrent_jobs.py.)
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class ConcurrentLauncher(Launcher):
    def __init__(self, n_jobs: int = -1) -> None:
        self.n_jobs = n_jobs
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config, self.task_function, self.hydra_context = config, task_function, hydra_context

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from src.launch.concurrent_jobs import launch

        return launch(
            self.n_jobs,
            self.hydra_context,
            self.task_function,
            self.config,
            job_overrides,
            initial_job_idx,
        )
