"""Know before you launch: predicted memory per device and communication per step, for every
strategy and device count, from the user's real model and batch.

Nothing here runs on a device. The model is built under torch's FakeTensorMode (tensors with
shapes, dtypes and storage sizes, but no data), and each device's share of a training step
(forward, the task's loss, backward and two optimizer steps, so that the optimizer state exists)
runs there under `MemTracker`, which records every storage alive per category (parameters,
gradients, optimizer state, activations and temporaries) and two peaks: while the model runs,
and at the optimizer step. Then its share of one evaluation batch (the forward and the task's
sums under no_grad, the optimizer state still held) gives the evaluation's peak. Which blocks,
how many samples and parts each device runs, and what a strategy adds (DDP's gradient buckets;
FSDP's gathered units, only while the model runs; a pipeline's boundary traffic) comes from the
strategy's `CostModel` (`Strategy.cost_model`, `src/parallel/base.py`: its `device_shares` and
`step_traffic`), asked once for the training micro-batch and once for the evaluation batch; the
planner never asks which strategy it holds. A strategy without a cost model still trains, but is
not planned: the planner says so in one line (`NoCostModel`).

Predictions are held to measured peaks (`src/launch/memory_check.py`, `scripts/benchmark.py --only
plan`). What it does not see: allocator caching and fragmentation, CUDA/NCCL workspaces, and
threads (dp's replicas run one after the other in the trace).

This module plans each candidate strategy and chooses among them; `plans.py` holds what a plan
is, `memory_trace.py` traces a device's share, `device_memory.py` makes its peaks the device's
memory, `step_time.py` predicts the step's time.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from src.components.data import build_data
from src.components.data_contract import Data
from src.components.model_contract import settle_model_settings
from src.components.optimizer import settle_optimizer_settings
from src.config.base import ConfigError
from src.config.job import JobConfig, job_config
from src.config.parallel import AUTO, Offload, at_least_one
from src.config.plan import PlanConfig
from src.config.trainer import Accelerator
from src.parallel import build_strategy
from src.parallel.base import CostModel, Strategy
from src.parallel.devices import resolve_device_type, usable_cores
from src.parallel.shares import ModelSizes
from src.planning.device_memory import TracedShare, device_plan
from src.planning.memory_trace import (
    check_traceable,
    meta_model_and_inputs,
    model_sizes,
    share_key,
    trace_share,
)
from src.planning.plans import CATEGORIES, MB, Plan
from src.planning.step_time import DeviceSpeed, measured_speed, step_time_s

log = logging.getLogger(__name__)
# The strategies to choose from: every `parallel=` option but auto.
STRATEGIES = sorted(
    path.stem
    for path in (Path(__file__).resolve().parents[2] / "conf" / "parallel").glob("*.yaml")
    if path.stem != AUTO
)


class NoCostModel(ConfigError):
    """A strategy the planner cannot price: it runs, but `Strategy.cost_model` gives None."""


def cost_model_of(strategy: Strategy) -> CostModel:
    """`strategy`'s cost model, or NoCostModel's one line naming its class."""
    costs = strategy.cost_model()
    if costs is None:
        kind = type(strategy)
        raise NoCostModel(
            f"parallel={strategy.name} ({kind.__module__}.{kind.__qualname__}) has no cost model "
            "(Strategy.cost_model returns None): it trains, but cannot be planned"
        )
    return costs


def check_plan_settings(plan: PlanConfig) -> None:
    """Refuse plan settings that cannot work, in one line, before any tracing (their ranges:
    `job_config`'s)."""
    unknown = [name for name in plan.strategies or [] if name not in STRATEGIES]
    if unknown:
        raise ConfigError(
            f"plan.strategies: unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}"
        )


def candidate_parallels(cfg: DictConfig | JobConfig, every: bool = False) -> list[DictConfig]:
    """The `parallel` configs to plan: `plan.strategies` (default: every one for parallel=auto
    or `every`, else the configured one) at `plan.devices` (default: `parallel.devices`). A
    strategy other than the configured one comes with its own option's settings
    (conf/parallel/<name>.yaml), composed through Hydra, which must be initialized (it is inside
    train.py and plan.py). `cfg`: composed, or typed already."""
    job = job_config(cfg)
    cfg, plan = job.cfg, job.plan
    check_plan_settings(plan)
    every = every or cfg.parallel.name == AUTO
    names = list(plan.strategies or (STRATEGIES if every else [cfg.parallel.name]))
    if not plan.devices:  # plan.devices' own counts are PlanConfig's to check
        at_least_one(cfg.parallel, "devices")
    counts = list(plan.devices or [cfg.parallel.devices])
    candidates = []
    for name in names:
        base = cfg.parallel if name == cfg.parallel.name else parallel_option(name)
        candidates += [OmegaConf.merge(base, {"devices": count}) for count in counts]
    return candidates


def parallel_option(name: str) -> DictConfig:
    """conf/parallel/<name>.yaml, composed."""
    return hydra.compose(config_name="config", overrides=[f"parallel={name}"]).parallel


def resolve_auto(cfg: DictConfig | JobConfig) -> DictConfig:
    """For parallel=auto, the composed config with the chosen strategy's `parallel` settings
    (why it was chosen in `parallel.chosen_by`, and logged); any other config as it is.
    `cfg`: composed, or typed already."""
    job = job_config(cfg)
    cfg = job.cfg
    if cfg.parallel.name != AUTO:
        return cfg
    best, why = choose(plan_all(job, candidate_parallels(job)))
    reason = f"parallel=auto chose {best.strategy} on {best.devices} device(s): {why}"
    log.info(reason)
    resolved = copy.deepcopy(cfg)
    resolved.parallel = OmegaConf.merge(best.parallel, {"chosen_by": reason})
    return resolved


def plan_all(
    cfg: DictConfig | JobConfig,
    parallels: Sequence[DictConfig],
    progress: Callable[[str], None] | None = None,
    speed: DeviceSpeed | None = None,
) -> list[Plan]:
    """A `Plan` for each of `parallels` (a `parallel` config each) with the rest of `cfg`;
    `progress` is told of each one as it is done; `speed` is the devices' (default:
    `measured_speed`). Devices whose share of a step is the same
    (ddp's and fsdp's replicas at one device count, say) are traced once. A strategy without a
    cost model is left out, in one logged line (`NoCostModel`), raised when it leaves none.
    `cfg`: composed, or typed already."""
    job = job_config(cfg)
    cfg = job.cfg
    settle_model_settings(cfg)
    settle_optimizer_settings(cfg)
    data = build_data(cfg.data, cfg.seed)
    sizes = model_sizes(cfg, data)
    traces: dict[tuple, TracedShare] = {}
    plans = []
    started = time.perf_counter()
    unplanned: list[NoCostModel] = []
    for index, parallel in enumerate(parallels, 1):
        try:
            plans.append(plan_one(job, parallel, data, sizes, traces, speed))
        except NoCostModel as error:
            unplanned.append(error)
        if progress:
            progress(
                f"planned {parallel.name} on {parallel.devices} device(s) "
                f"({index}/{len(parallels)}, {time.perf_counter() - started:.0f} s)"
            )
    if unplanned and not plans:
        raise unplanned[0]
    for error in unplanned:
        log.warning("left out: %s", error)
    return plans


def plan_one(
    job: JobConfig,
    parallel: DictConfig,
    data: Data,
    sizes: ModelSizes,
    traces: dict[tuple, TracedShare] | None = None,
    speed: DeviceSpeed | None = None,
) -> Plan:
    """`parallel`'s plan; `traces` holds the shares traced so far, by `share_key`. Raises
    NoCostModel for a strategy the planner cannot price."""
    plan = Plan(parallel.name, parallel.devices, parallel)
    cfg, trainer = job.cfg, job.trainer
    traces = {} if traces is None else traces
    micro_batch = trainer.batch_size // trainer.accumulate
    try:
        strategy = build_strategy(parallel, planned_device_type(job), trainer.precision)
        strategy.check_batch(micro_batch)
        strategy.check_accumulate(trainer.accumulate)
        model, inputs = meta_model_and_inputs(cfg, data, 2)
        strategy.check_model(model, inputs)
        costs = cost_model_of(strategy)
        shares = costs.device_shares(sizes, micro_batch)
        check_traceable(model, shares)
    except NoCostModel:
        raise
    except ConfigError as error:
        plan.problem = str(error)
        return plan
    eval_batch = min(trainer.eval_batch, len(data.val))  # the largest
    eval_shares = costs.device_shares(sizes, eval_batch)
    for share, eval_share in zip(shares, eval_shares, strict=True):
        key = (share_key(share), share_key(eval_share))
        if key not in traces:
            traces[key] = trace_share(job, data, share, eval_share)
        offloaded = parallel.get("offload") == Offload.cpu
        plan.device_plans.append(device_plan(traces[key], share, eval_share, offloaded))
    plan.traffic = costs.step_traffic(sizes, micro_batch, trainer.accumulate)
    plan.fits = plan.needed <= job.plan.device_memory_gb * 2**30
    speed = speed or measured_speed(strategy.device_type, job.plan)
    plan.messages = costs.step_messages(sizes, micro_batch, trainer.accumulate)
    plan.step_time_s = step_time_s(plan, strategy, costs, speed, usable_cores())
    return plan


def planned_device_type(job: JobConfig) -> str:
    """cpu or cuda: `plan.accelerator`, or where the run would train."""
    if job.plan.accelerator != Accelerator.auto:
        return job.plan.accelerator.value
    return resolve_device_type(job.trainer.accelerator)


# ----------------------------------------------------------------------------------------- table


def format_table(plans: Sequence[Plan], device_memory_gb: float, brief: bool = False) -> str:
    """The plans as a text table, one row per device of each plan, MB; `brief` names the plans
    that cannot run in one line at the end instead of a row each with the reason."""
    header = (
        f"{'strategy':<15}{'devices':>8}  {'device':<12}{'params':>9}{'grads':>9}{'optim':>9}"
        f"{'activ':>9}{'peak MB':>10}{'eval peak MB':>14}{'host MB':>9}{'traffic MB':>12}"
        f"{'fits':>6}"
    )
    lines = [f"device memory: {device_memory_gb:g} GB (plan.device_memory_gb)", header]
    for plan in plans:
        if plan.problem and brief:
            continue
        if plan.problem:
            lines.append(f"{plan.strategy:<15}{plan.devices:>8}  cannot run: {plan.problem}")
            continue
        traffic = sum(plan.traffic.values()) / MB
        for index, device in enumerate(plan.device_plans):
            figures = "".join(f"{getattr(device, name) / MB:>9.2f}" for name in CATEGORIES)
            first = index == 0
            lines.append(
                f"{plan.strategy if first else '':<15}{plan.devices if first else '':>8}  "
                f"{device.label:<12}{figures}{device.peak / MB:>10.2f}"
                f"{device.evaluation / MB:>14.2f}{device.host / MB:>9.2f}"
                + (f"{traffic:>12.2f}{'yes' if plan.fits else 'NO':>6}" if first else "")
            )
        if plan.traffic:
            parts = ", ".join(f"{name} {size / MB:.2f} MB" for name, size in plan.traffic.items())
            lines.append(f"{'':<25}traffic per step: {parts}")
    unrunnable = [f"{plan.strategy} x{plan.devices}" for plan in plans if plan.problem]
    if brief and unrunnable:
        lines.append(
            f"cannot run: {', '.join(unrunnable)} (plan one with parallel=<name> to see why)"
        )
    return "\n".join(lines)


def choose(plans: Sequence[Plan]) -> tuple[Plan, str]:
    """The plan with the shortest predicted step among those that fit (single on a tie), and
    why, in one line."""
    runnable = [plan for plan in plans if plan.problem is None]
    fitting = [plan for plan in runnable if plan.fits]
    if not fitting:
        smallest = min(runnable, key=lambda plan: plan.needed, default=None)
        need = f"; the smallest needs {smallest.needed / MB:.0f} MB per device" if smallest else ""
        raise ConfigError(
            f"no strategy fits plan.device_memory_gb{need}; raise plan.device_memory_gb or "
            "parallel.devices, or lower trainer.batch_size (or trainer.eval_batch_size)"
        )
    # On a tie (on one device every strategy predicts single's step) the plain run wins.
    best = min(fitting, key=lambda plan: (plan.step_time_s, plan.strategy != "single"))
    others = ", ".join(
        f"{plan.strategy} x{plan.devices} {plan.step_time_s * 1e3:.3g} ms"
        for plan in fitting
        if plan is not best
    )
    left_out = [plan.strategy for plan in runnable if not plan.fits]
    reason = (
        f"predicted {best.step_time_s * 1e3:.3g} ms per step and {best.needed / MB:.1f} MB per "
        f"device, the fastest of those that fit ({others or 'no other'})"
        + (f"; too big: {', '.join(left_out)}" if left_out else "")
    )
    return best, reason


def recommendation(plans: Sequence[Plan]) -> str:
    """The line that ends `python plan.py`'s comparison: which to run, and why."""
    best, why = choose(plans)
    return f"recommended: parallel={best.strategy} parallel.devices={best.devices}: {why}"
