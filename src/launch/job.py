"""One Hydra job: train in this process, launch the ranks of a multi-process strategy, or run as
one of the ranks that torchrun or srun started.

`run(cfg)` is what `train.py` calls inside the Hydra job; `sweep.run_job` reads the ranks from
the environment once, and records the outcome of a sweep's job. Every check that can fail on
bad input runs before any process, device or tracker is touched: the launcher checks on the meta
device (`build.build_blueprint`) before it starts a rank.
"""

from __future__ import annotations

import logging
import shlex
import signal
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.checkpoint.store import saved_checkpoints
from src.config.base import ConfigError, plain_config
from src.config.parallel import AUTO
from src.launch.as_rank import configure_logging, join_started_ranks, run_as_rank
from src.launch.forking import start_rank_server
from src.launch.launcher import JobFailed, KilledBySignal, launch
from src.launch.sweep import run_job
from src.observe.tracking import wandb_group
from src.parallel.base import Strategy
from src.runtime.ranks import Ranks
from src.runtime.stopping import Interrupted, ProcessDied, RunStopped, StopOnSignal
from src.training.build import build_blueprint
from src.training.checks import check_settings
from src.training.resume import finished
from src.training.summary import finish_finished_run
from src.training.trainer import Trainer, train

log = logging.getLogger(__name__)
# Its records go to train.log only (conf/config.yaml), not to the console.
train_log_only = logging.getLogger("train_log_only")


@run_job
def run(cfg: DictConfig, ranks: Ranks | None) -> dict[str, Any]:
    """Train in this process, in processes started here, or as one of `ranks` (started by
    torchrun or srun); returns the summary of this node's lowest rank."""
    hydra = HydraConfig.get()
    run_dir = Path(hydra.runtime.output_dir)
    if cfg.parallel.name == AUTO:  # imported only then: its tracing tools take a second to load
        from src.planning.planner import resolve_auto

        cfg = resolve_auto(cfg)  # the planner's choice from here on
    if "group" in cfg.logger:  # `eval.py`'s runs of this run join its W&B group
        cfg.logger.group = wandb_group(cfg.logger, run_dir)
    strategy = check_settings(cfg, ranks)
    nodes = cfg.parallel.nodes
    processes = strategy.processes_per_node * nodes
    if ranks is None and processes > 1:
        check_rendezvous(cfg.parallel)
        start_rank_server()  # unless train.py has: it imports what the ranks need meanwhile
    blueprint = build_blueprint(cfg, run_dir, strategy)
    if blueprint.saved is not None and finished(blueprint.saved, cfg):
        return finish_finished_run(
            cfg, run_dir, strategy, blueprint.checkpoint, blueprint.saved, ranks
        )
    job_logging = OmegaConf.to_container(hydra.job_logging, resolve=True)
    if ranks is not None:
        check_started_ranks(ranks, strategy, nodes)
        join_started_ranks(ranks, str(run_dir), job_logging)
        if ranks.rank == 0:
            log_config(cfg)
        return run_as_rank(ranks, train, cfg, run_dir, strategy, blueprint, outcomes=(RunStopped,))
    if processes == 1:
        log_config(cfg)
        with Trainer(cfg, run_dir, strategy, blueprint) as trainer:
            return trainer.train()
    configure_logging(job_logging, "launcher")
    log_config(cfg)
    resolved = plain_config(cfg)
    return launch_ranks(
        resolved, run_dir, blueprint.checkpoint, strategy.processes_per_node, nodes, job_logging
    )


def check_rendezvous(parallel: DictConfig) -> None:
    """Ranks launched here on several nodes must meet at an address every node can reach. (Under
    srun or torchrun the rendezvous comes from their environment instead.)"""
    if parallel.nodes > 1 and parallel.master_port == 0:
        raise ConfigError(
            "parallel.nodes > 1 needs a rendezvous every node can reach: set "
            "parallel.master_addr to the first node and parallel.master_port to a free port"
        )


def check_started_ranks(ranks: Ranks, strategy: Strategy, nodes: int) -> None:
    if ranks.world_size != strategy.processes_per_node * nodes:
        raise ConfigError(
            f"{ranks.world_size} processes were started ({ranks.local_world_size} per node) "
            f"but parallel={strategy.name} runs {strategy.processes_per_node} per node on "
            f"{nodes} node(s): make parallel.devices (and parallel.nodes) match the launcher"
        )


def log_config(cfg: DictConfig) -> None:
    log.info("overrides: %s", " ".join(HydraConfig.get().overrides.task) or "none")
    train_log_only.info("config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))


def launch_ranks(
    resolved_cfg: dict[str, Any],
    run_dir: Path,
    checkpoint: Path | None,
    per_node: int,
    nodes: int,
    job_logging: dict[str, Any],
) -> dict[str, Any]:
    """`launch` the ranks of `train_worker`. A first SIGINT/SIGTERM stops them together after a
    step (they raise the stop, and so does this); a second one kills them (or the first, before
    they have started); a process of the job that dies or fails ends it: then the last
    checkpoint says where the run can resume from."""
    parallel = OmegaConf.create(resolved_cfg["parallel"])
    args = (resolved_cfg, str(run_dir), checkpoint and str(checkpoint))
    try:
        return launch(train_worker, args, per_node, nodes, parallel, job_logging, (RunStopped,))
    except KilledBySignal as stopped:
        name = signal.Signals(stopped.signum).name
        kept = last_checkpoint(run_dir)
        raise Interrupted(f"stopped by {name} at once; {kept}", 128 + stopped.signum) from None
    except JobFailed as failed:
        raise ProcessDied(f"{failed}; the job stopped and {last_checkpoint(run_dir)}") from None


def last_checkpoint(run_dir: Path) -> str:
    saved = saved_checkpoints(run_dir)  # a checkpoint is never half-written
    return f"the last checkpoint is {saved[-1]}" if saved else "no checkpoint was written"


def train_worker(
    resolved_cfg: dict[str, Any],
    run_dir: str,
    checkpoint: str | None,
    ranks: Ranks,
    stop: StopOnSignal,
) -> dict[str, Any]:
    """`train` in a process started by `launch`, from the config the launcher checked and the
    checkpoint it found to resume from, if any. A stop that every rank made at the same step
    (they agree on signals and non-finite losses) is raised, and `launch` raises it again in the
    launcher."""
    cfg = OmegaConf.create(resolved_cfg)
    strategy = check_settings(cfg, ranks)
    checked = Path(checkpoint) if checkpoint else None
    blueprint = build_blueprint(cfg, Path(run_dir), strategy, checked)
    return train(cfg, Path(run_dir), strategy, blueprint, stop=stop)


def resume_hint() -> str:
    """How to continue this Hydra job's run from its last checkpoint: the command line of a
    single run; for a job of a sweep, the sweep's own command (`src.sweep` resumes its jobs; on
    SLURM, a requeued job resumes by itself)."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return (
            "it resumes when its sweep runs again (the same -m command with "
            f"hydra.sweep.dir={hydra_cfg.sweep.dir})"
        )
    return f"resume with:\n  {resume_command(hydra_cfg)}"


def resume_command(hydra_cfg: DictConfig) -> str:
    """The command line that continues this single run from its last checkpoint."""
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("trainer.resume=")]
    return shlex.join(
        [
            "python",
            "train.py",
            *overrides,
            "trainer.resume=auto",
            f"hydra.run.dir={hydra_cfg.runtime.output_dir}",
        ]
    )
