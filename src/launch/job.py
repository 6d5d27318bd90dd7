"""One Hydra job: train in this process, launch the ranks of a multi-process strategy, or run as
one of the ranks that torchrun or srun started.

`run(cfg)` is what `train.py` calls inside the Hydra job; `sweep.run_job` reads the ranks from
the environment once, and records the outcome of a sweep's job. Every check that can fail on
bad input runs before any process, device or tracker is touched: the launcher checks on the meta
device (`build.build_blueprint`) before it starts a rank.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shlex
import signal
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.checkpoint.store import checkpoint_step, saved_checkpoints
from src.config.base import ConfigError, plain_config
from src.config.job import JobConfig, job_config
from src.config.parallel import AUTO, NodeRange, node_range
from src.launch.as_rank import configure_logging, join_started_ranks, rank_store, run_as_rank
from src.launch.launcher import JobFailed, KilledBySignal, launch
from src.launch.rendezvous import RESUME_KEY, Round, Rounds
from src.launch.store_answers import STORE_ANSWER_S, answer_within
from src.launch.sweep import run_job
from src.observe.tracking import tracking_group
from src.parallel.base import Strategy
from src.runtime.forking import start_rank_server
from src.runtime.ranks import Ranks
from src.runtime.run_folder import metrics_file
from src.runtime.stopping import Interrupted, ProcessDied, RunStopped, StopOnSignal
from src.training.build import build_blueprint
from src.training.checks import check_settings
from src.training.loop import history_step
from src.training.resume import finished
from src.training.summary import finish_finished_run, save_summary
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
    job = job_config(cfg)  # typed once, here: a setting out of range stops the job now
    if cfg.parallel.name == AUTO:  # imported only then: its tracing tools take a second to load
        from src.planning.planner import resolve_auto

        cfg = resolve_auto(job)  # the planner's choice from here on
        job = dataclasses.replace(job, cfg=cfg)
    if "group" in cfg.logger:  # `eval.py`'s runs of this run join its loggers' group
        cfg.logger.group = tracking_group(cfg.logger, run_dir)
    nodes = node_range(cfg.parallel.nodes)
    if ranks is not None:  # the strategy spans the nodes started
        cfg.parallel.nodes = started_nodes(ranks, nodes)
    strategy = check_settings(job, ranks)
    if ranks is None:
        check_fewer_nodes(job, nodes)
    processes = strategy.processes_per_node * nodes.most
    if ranks is None and processes > 1:
        check_rendezvous(cfg.parallel)
        start_rank_server()  # unless train.py has: it imports what the ranks need meanwhile
    blueprint = build_blueprint(job, run_dir, strategy)
    if blueprint.saved is not None and finished(blueprint.saved, job.trainer):
        return finish_finished_run(
            job, run_dir, strategy, blueprint.checkpoint, blueprint.saved, ranks
        )
    job_logging = OmegaConf.to_container(hydra.job_logging, resolve=True)
    if ranks is not None:
        check_started_ranks(ranks, strategy, nodes)
        join_started_ranks(ranks, str(run_dir), job_logging)
        if ranks.rank == 0:
            log_config(cfg)
        return run_as_rank(ranks, train, job, run_dir, strategy, blueprint, outcomes=(RunStopped,))
    if processes == 1:
        log_config(cfg)
        with Trainer(job, run_dir, strategy, blueprint) as trainer:
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
    if node_range(parallel.nodes).most > 1 and parallel.master_port == 0:
        raise ConfigError(
            "parallel.nodes > 1 needs a rendezvous every node can reach: set "
            "parallel.master_addr to the first node and parallel.master_port to a free port"
        )


def check_fewer_nodes(job: JobConfig, nodes: NodeRange) -> None:
    """An elastic job's settings must also hold on each number of nodes it may go on with (the
    batch splits over fewer ranks): checked before any rank starts, not at the restart."""
    for count in range(nodes.least, nodes.most):
        fewer = job.cfg.copy()
        fewer.parallel.nodes = count
        try:
            check_settings(dataclasses.replace(job, cfg=fewer), None)
        except ConfigError as error:
            message = f"on {count} node(s) of parallel.nodes={job.cfg.parallel.nodes}: {error}"
            raise ConfigError(message) from None


def started_nodes(ranks: Ranks, nodes: NodeRange) -> int:
    """The nodes `ranks` run on, where `nodes` admits that many (an elastic job re-formed on
    fewer); else its most, for `check_started_ranks` to refuse."""
    started = ranks.world_size // max(1, ranks.local_world_size)
    return started if nodes.least <= started <= nodes.most else nodes.most


def check_started_ranks(ranks: Ranks, strategy: Strategy, nodes: NodeRange) -> None:
    per_node = strategy.processes_per_node
    if ranks.world_size not in {per_node * count for count in range(nodes.least, nodes.most + 1)}:
        counted = f"{nodes.least} to {nodes.most}" if nodes.elastic else nodes.most
        raise ConfigError(
            f"{ranks.world_size} processes were started ({ranks.local_world_size} per node) "
            f"but parallel={strategy.name} runs {per_node} per node on "
            f"{counted} node(s): make parallel.devices (and parallel.nodes) match the launcher"
        )


def log_config(cfg: DictConfig) -> None:
    log.info("overrides: %s", " ".join(HydraConfig.get().overrides.task) or "none")
    train_log_only.info("config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))


def launch_ranks(
    resolved_cfg: dict[str, Any],
    run_dir: Path,
    checkpoint: Path | None,
    per_node: int,
    nodes: NodeRange,
    job_logging: dict[str, Any],
) -> dict[str, Any]:
    """`launch` the ranks of `train_worker`. A first SIGINT/SIGTERM stops them together after a
    step (they raise the stop, and so does this); a second one kills them (or the first, before
    they have started); a process of the job that dies or fails ends it: then the last
    checkpoint says where the run can resume from. An elastic job re-formed on fewer nodes says
    so in a line and in summary.json (`NodesLost`)."""
    parallel = OmegaConf.create(resolved_cfg["parallel"])
    args = (resolved_cfg, str(run_dir), checkpoint and str(checkpoint))
    losses = NodesLost(run_dir)
    rounds = Rounds(reformed=losses.reformed)
    try:
        summary = launch(
            train_worker, args, per_node, nodes, parallel, job_logging, (RunStopped,), rounds
        )
    except KilledBySignal as stopped:
        name = signal.Signals(stopped.signum).name
        kept = last_checkpoint(run_dir)
        raise Interrupted(f"stopped by {name} at once; {kept}", 128 + stopped.signum) from None
    except JobFailed as failed:
        raise ProcessDied(f"{failed}; the job stopped and {last_checkpoint(run_dir)}") from None
    if losses.events and rounds.seen[-1].rank == 0:  # this node's rank 0 wrote the summary
        summary["nodes_lost"] = losses.events
        save_summary(summary, run_dir)
    return summary


class NodesLost:
    """What each re-forming of an elastic job cost, as this node's launcher saw it: `reformed`
    logs one line and keeps an event for summary.json's `nodes_lost`."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.events: list[dict[str, Any]] = []

    def reformed(self, before: Round, now: Round) -> None:
        """Called as the job's rendezvous re-forms, before the ranks restart: the last step
        logged (metrics.jsonl; trainer.log_every apart) is where nodes were lost or joined, the
        last checkpoint where the ranks resume; the time lost runs from that step's log to the
        job re-formed (the steps redone cost their time again after it)."""
        lost = [node for node in before.nodes if node not in now.nodes]
        joined = [node for node in now.nodes if node not in before.nodes]
        history = metrics_file(self.run_dir)
        rows = history.read_text().splitlines() if history.exists() else []
        # Whole lines only: a line cut short by a crash has no step (math.inf).
        reached = int(max((s for s in map(history_step, rows) if s < math.inf), default=0))
        last_progress = history.stat().st_mtime if rows else now.asked
        saved = saved_checkpoints(self.run_dir)
        resumed = checkpoint_step(saved[-1]) if saved else 0
        event = {
            "lost": lost,
            "joined": joined,
            "at_step": reached,
            "resumed_from_step": resumed,
            "steps_redone": reached - resumed,
            "nodes": len(now.nodes),
            "seconds_lost": round(now.formed - last_progress, 1),
        }
        self.events.append(event)
        changes = [f"node(s) {', '.join(lost)} lost"] if lost else []
        changes += [f"node(s) {', '.join(joined)} joined"] if joined else []
        log.warning(
            "%s at step %d: the job re-formed on %d node(s) after %.1f s and resumes from step "
            "%d (%d step(s) redone)",
            " and ".join(changes) or "a rank failed",
            reached,
            event["nodes"],
            event["seconds_lost"],
            resumed,
            event["steps_redone"],
        )


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
    launcher. Restarted in an elastic job re-formed (a node lost or joined), the ranks resume
    from the newest checkpoint instead, on the nodes the job has now."""
    cfg = OmegaConf.create(resolved_cfg)
    nodes = node_range(cfg.parallel.nodes)
    cfg.parallel.nodes = started_nodes(ranks, nodes)
    if nodes.elastic and goes_on_with_reformed_job():  # a store question only an elastic job asks
        cfg.trainer.resume, checkpoint = "auto", None
    job = job_config(cfg)
    strategy = check_settings(job, ranks)
    checked = Path(checkpoint) if checkpoint else None
    blueprint = build_blueprint(job, Path(run_dir), strategy, checked)
    return train(job, Path(run_dir), strategy, blueprint, stop=stop)


def goes_on_with_reformed_job() -> bool:
    """Whether this rank's launcher has re-formed its elastic job (`RESUME_KEY` in its store):
    the first round of a node that joins later counts, which its agent does not count as a
    restart."""
    return bool(answer_within(STORE_ANSWER_S, lambda: rank_store().check([RESUME_KEY])))


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
