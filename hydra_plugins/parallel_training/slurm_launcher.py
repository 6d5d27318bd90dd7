"""The SLURM launcher behind `hydra/launcher=slurm`: hydra-submitit-launcher, sized per job.

(Hydra takes launchers only from the `hydra_plugins` package, hence this file's place; Hydra
imports it at every start, so everything heavy is imported where it is used.)

hydra-submitit-launcher reads nodes, tasks and GPUs once per multirun, from the sweep's primary
config, where swept values such as `parallel.devices=1,2,4,8` do not appear. This launcher submits
each job on its own, sized from that job's config:

    nodes          parallel.nodes
    gpus_per_node  parallel.devices; none with trainer.accelerator=cpu, or on a CPU partition
                   (hydra.launcher.gpus_per_node=0)
    tasks_per_node the strategy's processes per node: one per GPU for ddp, 1 for single, dp and
                   model_parallel, which drive all their GPUs from one process

In each task, the ranks come from SLURM's environment
(`src.launch.as_rank.adopt_slurm_environment`, as under a plain `srun train.py`), so a ddp job
joins the ranks SLURM started instead of launching its own. All jobs are submitted, then waited for,
so they run as the cluster allows; a job that sbatch refuses ends the sweep with sbatch's reason
(exit 2), and cancels the jobs submitted before it. A combination that cannot run gets a one-task
allocation without GPUs, only to record itself as skipped.

Time limits and pre-emption: SLURM sends `hydra.launcher.signal` (USR2, 120 s before the limit)
to every task. It stops the run as SIGTERM does, every rank after the same step, checkpointed;
then the job requeues itself and, run again, resumes from that checkpoint (a job of a sweep
resumes its own run folder, `src.launch.sweep`). SIGTERM (scontrol requeue, pre-emption, scancel,
the limit itself) stops it the same way, and SLURM decides whether it runs again. A stopped task
leaves no result, so the sweep waits for the job's next run.
"""

import copy
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from omegaconf import DictConfig

log = logging.getLogger(__name__)


@dataclass  # (the module has no `from __future__ import annotations`: Hydra's plugin scan loads
class SlurmConfig(SlurmQueueConf):  # it outside sys.modules, where dataclass cannot read them)
    """hydra-submitit-launcher's settings, and the signal before the time limit."""

    _target_: str = "hydra_plugins.parallel_training.slurm_launcher.SlurmLauncher"
    signal: str = "USR2@120"
    """sbatch's --signal: SIGNAL@SECONDS before the time limit (replaces signal_delay_s)."""


ConfigStore.instance().store(group="schema/hydra/launcher", name="slurm", node=SlurmConfig)


def slurm_resources(cfg: DictConfig) -> dict[str, int | None]:
    """The allocation one job needs: `nodes`, `tasks_per_node`, `gpus_per_node`."""
    from src.parallel import build_strategy
    from src.parallel.base import ConfigError

    try:
        # Built for CPU only to ask for its process layout: the submitting host may have no GPU.
        strategy = build_strategy(cfg.parallel, "cpu")
    except ConfigError:
        return {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": None}  # runs only to say why not
    cpu_partition = cfg.hydra.launcher.get("gpus_per_node") == 0
    uses_gpus = cfg.trainer.accelerator != "cpu" and not cpu_partition
    return {
        "nodes": strategy.cfg.nodes,  # its most, if elastic
        "tasks_per_node": strategy.processes_per_node,
        "gpus_per_node": cfg.parallel.devices if uses_gpus else None,
    }


def signal_number(setting: str) -> int:
    """The signal of an sbatch `--signal` setting: 'USR2@120' -> SIGUSR2."""
    name = setting.split("@")[0].upper()
    return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """One SLURM task of a job: runs its Hydra job as one of the job's ranks. Stopped by a
        signal, the task exits without a result (the job runs again, or ends as SLURM ended it);
        stopped by `hydra.launcher.signal`, the job requeues itself first."""
        requeue_signal = signal_number(self.params["signal"])
        # Noted from now on, instead of submitit's handler: importing torch takes seconds.
        received = []
        signal.signal(requeue_signal, lambda signum, frame: received.append(signum))
        from src.launch.as_rank import adopt_slurm_environment
        from src.runtime.stopping import stopping_also_on

        adopt_slurm_environment()
        try:
            with stopping_also_on(requeue_signal, received_already=bool(received)):
                return super().__call__(*args, **kwargs)
        except SystemExit as stopped:  # train.py's exit for a stopped run: 128 + the signal
            job_id = os.environ["SLURM_JOB_ID"]
            requeue = stopped.code == 128 + requeue_signal
            if requeue and os.environ.get("SLURM_PROCID", "0") == "0":
                subprocess.run(["scontrol", "requeue", job_id], check=True)
                log.warning("job %s requeued: it resumes from its checkpoint when it runs", job_id)
            raise  # not an Exception: submitit writes no result

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from src.launch.slurm_jobs import SubmissionRefused, job_result, watch_job_states

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("Submitit 'slurm' sweep output dir : %s", sweep_dir)
        watch_job_states()
        jobs = []
        for job_num, overrides in enumerate(job_overrides, start=initial_job_idx):
            job_cfg = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides)
            )
            log.info("\t#%d : %s", job_num, " ".join(filter_overrides(overrides)))
            try:
                jobs.append(self.submit(job_cfg, overrides, job_num))
            except SubmissionRefused as refused:
                for job in jobs:
                    job.cancel(check=False)
                cancelled = f"; cancelled jobs {', '.join(j.job_id for j in jobs)}" if jobs else ""
                print(f"train.py: error: {refused}{cancelled}", file=sys.stderr)
                raise SystemExit(2) from None
        return [job_result(*submitted) for submitted in zip(jobs, job_overrides, strict=True)]

    def submit(self, job_cfg: DictConfig, overrides: Sequence[str], job_num: int) -> Any:
        """Submit one job, sized from its own config (`src.launch.slurm_jobs.submit`)."""
        from src.launch.slurm_jobs import submit

        launcher = copy.copy(self)
        launcher.params = {**self.params, **slurm_resources(job_cfg)}
        args = (list(overrides), "hydra.sweep.dir", job_num, f"job_id_for_{job_num}")
        return submit(launcher.params, job_num, launcher, *args, Singleton.get_state())
