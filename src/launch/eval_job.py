"""One `python eval.py` job: the evaluated run's config as the base of the command line, then
the evaluation in this process, in ranks launched here (as `train.py` launches them), or as one
of the ranks that torchrun or srun started.

Before Hydra composes the config, `with_saved_run` finds the checkpoint that `ckpt_path` names and
stores its config (the run's, resolved) as each group's `saved_run` option, selected unless the
command line chooses another: the model is rebuilt as it was trained, and the command line's
overrides apply on top, group by group and key by key, checked by the schemas as train.py's are.
`parallel` stays eval.py's own (`single` unless given): any layout reads any checkpoint.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf

from src.config.base import ConfigError, plain_config
from src.config.job import job_config
from src.config.parallel import node_range
from src.config.schema import SAVED_GROUPS, SAVED_RUN, store_saved_run
from src.launch.as_rank import configure_logging, join_started_ranks, run_as_rank, started_ranks
from src.launch.job import check_rendezvous, check_started_ranks, log_config
from src.launch.launcher import JobFailed, KilledBySignal, launch
from src.runtime.forking import start_rank_server
from src.runtime.ranks import Ranks
from src.runtime.stopping import Interrupted, ProcessDied, StopOnSignal
from src.training.checks import check_settings
from src.training.evaluator import as_evaluated, eval_blueprint, evaluate_checkpoint

CKPT_PATH, RUN_DIR, SEED = "ckpt_path", "run_dir", "seed"


def with_saved_run(args: list[str]) -> list[str]:
    """eval.py's command line `args` as Hydra is to compose it: the checkpoint's config
    selected first (see above; `seed` too), and `ckpt_path` the checkpoint folder it names.
    Unchanged without a `ckpt_path` (Hydra then says it is missing) or where Hydra cannot parse
    the overrides (it says so); a ConfigError if `ckpt_path` names no complete checkpoint."""
    from src.checkpoint.locate import named_checkpoint, saved_config

    overrides = [arg for arg in args if not arg.startswith("-")]  # not Hydra's flags
    try:
        parsed = {o.key_or_group: o for o in OverridesParser.create().parse_overrides(overrides)}
    except OverrideParseException:
        return args
    if CKPT_PATH not in parsed:
        return args
    run_dir = parsed[RUN_DIR].value() if RUN_DIR in parsed else None
    checkpoint = named_checkpoint(str(parsed[CKPT_PATH].value()), run_dir)
    config = saved_config(checkpoint)
    store_saved_run(config)
    selected = [
        f"{group}={SAVED_RUN}" for group in SAVED_GROUPS if group in config and group not in parsed
    ]
    seed = [] if SEED in parsed or SEED not in config else [f"{SEED}={config[SEED]}"]
    quoted = str(checkpoint).replace("\\", "\\\\").replace("'", "\\'")
    named = [
        f"{CKPT_PATH}='{quoted}'" if arg == parsed[CKPT_PATH].input_line else arg for arg in args
    ]
    return [*selected, *seed, *named]


def run_eval(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate in this process, in processes started here, or as one of the ranks torchrun or
    srun started; returns the figures of this node's lowest rank (eval.json's)."""
    if OmegaConf.is_missing(cfg, CKPT_PATH):
        raise ConfigError(
            "ckpt_path is required: a run folder, a checkpoint folder, or best / last (of "
            "run_dir=<run folder>, or of the newest run in outputs/)"
        )
    ranks = started_ranks()
    hydra = HydraConfig.get()
    eval_dir = Path(hydra.runtime.output_dir)
    as_evaluated(cfg)
    job = job_config(cfg)  # typed once, here
    strategy = check_settings(job, ranks)
    nodes = node_range(cfg.parallel.nodes)
    processes = strategy.processes_per_node * nodes.most
    if ranks is None and processes > 1:
        check_rendezvous(cfg.parallel)
        start_rank_server()
    blueprint = eval_blueprint(job, strategy)  # every check, before any rank starts
    job_logging = OmegaConf.to_container(hydra.job_logging, resolve=True)
    if ranks is not None:
        check_started_ranks(ranks, strategy, nodes)
        join_started_ranks(ranks, str(eval_dir), job_logging)
        if ranks.rank == 0:
            log_config(cfg)
        return run_as_rank(ranks, eval_worker, plain_config(cfg), str(eval_dir), ranks)
    if processes == 1:
        log_config(cfg)
        return evaluate_checkpoint(job, eval_dir, strategy, blueprint)
    configure_logging(job_logging, "launcher")
    log_config(cfg)
    args, per_node = (plain_config(cfg), str(eval_dir)), strategy.processes_per_node
    try:
        return launch(eval_worker, args, per_node, nodes.most, cfg.parallel, job_logging)
    except KilledBySignal as stopped:
        name = signal.Signals(stopped.signum).name
        raise Interrupted(f"stopped by {name}", 128 + stopped.signum) from None
    except JobFailed as failed:
        raise ProcessDied(str(failed)) from None


def eval_worker(
    resolved_cfg: dict[str, Any], eval_dir: str, ranks: Ranks, stop: StopOnSignal
) -> dict[str, Any]:
    """`evaluate_checkpoint` as one rank of the job, from the config the launcher checked. An
    evaluation is short: a stop signal waits for its end (`stop`, which `run_as_rank` holds)."""
    job = job_config(OmegaConf.create(resolved_cfg))
    return evaluate_checkpoint(job, Path(eval_dir), check_settings(job, ranks))
