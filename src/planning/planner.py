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
strategy itself, through `Strategy.device_shares` and `Strategy.step_traffic`
(`src/parallel/base.py`), asked once for the training micro-batch and once for the evaluation
batch; this module never asks which strategy it holds.

Predictions are held to measured peaks (`src/launch/memory_check.py`, `scripts/benchmark.py --only
plan`). What it does not see: allocator caching and fragmentation, CUDA/NCCL workspaces, and
threads (dp's replicas run one after the other in the trace).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _State
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from src.components.blocks import prepare_blocks
from src.components.data import Data, build_data, first_samples
from src.components.optimizer import build_optimizer
from src.components.precision import autocast
from src.config.base import ConfigError, typed
from src.config.parallel import AUTO
from src.config.plan import PlanConfig
from src.config.trainer import Accelerator, TrainerConfig
from src.parallel import build_strategy
from src.parallel.base import (
    DeviceShare,
    ModelSizes,
    PlannedStrategy,
    resolve_device_type,
    tied_block_groups,
    usable_cores,
)

log = logging.getLogger(__name__)
MB = 2**20
# The strategies to choose from: every `parallel=` option but auto.
STRATEGIES = sorted(
    path.stem
    for path in (Path(__file__).resolve().parents[2] / "conf" / "parallel").glob("*.yaml")
    if path.stem != AUTO
)
# Measured (src/launch/memory_check.py): the second step's peak has the optimizer state.
TRACED_STEPS = 2
CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
# MemTracker's categories, summed into the plan's four.
TRACKED_AS = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.BUFFER: "parameters",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "activations",
    _MemRefType.OTH: "activations",
}


# The two moments of a step whose peaks the planner compares: while the model runs (forward,
# loss and backward; what a strategy holds then, such as FSDP's gathered units, is added to
# this one) and the rest (the optimizer step).
RUNNING, STEPPING = "running", "stepping"


class StepMemTracker(MemTracker):
    """`MemTracker` for whole training steps: the model may run several times per step
    (accumulation micro-steps), which MemTracker refuses for a root module. Its per-module
    statistics are dropped at each new forward pass of the root; the peak of the one device
    traced is kept, and apart for the moments `RUNNING` and `STEPPING` (`phase_peaks`)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase_peaks: dict[str, dict[Any, int]] = {}

    def _update_peak_stats(self, peak_state: _State) -> None:
        super()._update_peak_stats(peak_state)
        tracker = self._mod_tracker
        running = not self._in_opt and (tracker.is_bw or len(tracker.parents) > 1)  # not Global
        phase = RUNNING if running else STEPPING
        for snapshot in self._curr_mem_snap.values():
            if snapshot[_TOTAL_KEY] > self.phase_peaks.get(phase, {}).get(_TOTAL_KEY, -1):
                self.phase_peaks[phase] = dict(snapshot)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        tracker = self._mod_tracker
        root = set(tracker.parents) - {tracker.get_known_fqn(module)} == {"Global"}
        if root and module in self.memory_tracking and not tracker.is_bw:
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)


@dataclass
class DevicePlan:
    """One device's predicted peak, split by what holds the memory (bytes)."""

    label: str
    devices: int = 1  # that this entry stands for (see DeviceShare.devices)
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    flops: int = 0
    evaluation: int = 0
    """The peak while it evaluates one batch: its state, and the forward's live activations."""

    @property
    def peak(self) -> int:
        return sum(getattr(self, name) for name in CATEGORIES)


@dataclass
class Plan:
    """One strategy at one device count: its devices, its traffic, and whether it fits."""

    strategy: str
    devices: int
    parallel: DictConfig
    device_plans: list[DevicePlan] = field(default_factory=list)
    traffic: dict[str, int] = field(default_factory=dict)
    step_time_s: float = math.nan
    fits: bool = False
    problem: str | None = None  # why it cannot run (the ConfigError it raises)

    @property
    def peak(self) -> int:
        return max((device.peak for device in self.device_plans), default=0)

    @property
    def eval_peak(self) -> int:
        return max((device.evaluation for device in self.device_plans), default=0)

    @property
    def needed(self) -> int:
        """The memory a run needs of its fullest device: training's or evaluation's peak."""
        return max(self.peak, self.eval_peak)


def check_plan_settings(plan: DictConfig) -> None:
    """Refuse plan settings that cannot work, in one line, before any tracing."""
    typed(PlanConfig, plan)  # its ranges
    unknown = [name for name in plan.strategies or [] if name not in STRATEGIES]
    if unknown:
        raise ConfigError(
            f"plan.strategies: unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}"
        )


def candidate_parallels(cfg: DictConfig, every: bool = False) -> list[DictConfig]:
    """The `parallel` configs to plan: `plan.strategies` (default: every one for parallel=auto
    or `every`, else the configured one) at `plan.devices` (default: `parallel.devices`). A
    strategy other than the configured one comes with its own option's settings
    (conf/parallel/<name>.yaml), composed through Hydra, which must be initialized (it is inside
    train.py and plan.py)."""
    check_plan_settings(cfg.plan)
    every = every or cfg.parallel.name == AUTO
    names = list(cfg.plan.strategies or (STRATEGIES if every else [cfg.parallel.name]))
    counts = list(cfg.plan.devices or [cfg.parallel.devices])
    candidates = []
    for name in names:
        base = cfg.parallel if name == cfg.parallel.name else parallel_option(name)
        candidates += [OmegaConf.merge(base, {"devices": count}) for count in counts]
    return candidates


def parallel_option(name: str) -> DictConfig:
    """conf/parallel/<name>.yaml, composed."""
    return hydra.compose(config_name="config", overrides=[f"parallel={name}"]).parallel


def resolve_auto(cfg: DictConfig) -> DictConfig:
    """For parallel=auto, `cfg` with the chosen strategy's `parallel` settings (why it was
    chosen in `parallel.chosen_by`, and logged); any other config as it is."""
    if cfg.parallel.name != AUTO:
        return cfg
    best, why = choose(plan_all(cfg, candidate_parallels(cfg)))
    reason = f"parallel=auto chose {best.strategy} on {best.devices} device(s): {why}"
    log.info(reason)
    resolved = copy.deepcopy(cfg)
    resolved.parallel = OmegaConf.merge(best.parallel, {"chosen_by": reason})
    return resolved


def plan_all(
    cfg: DictConfig,
    parallels: Sequence[DictConfig],
    progress: Callable[[str], None] | None = None,
    speed: DeviceSpeed | None = None,
) -> list[Plan]:
    """A `Plan` for each of `parallels` (a `parallel` config each) with the rest of `cfg`;
    `progress` is told of each one as it is done; `speed` is the devices' (default:
    `measured_speed`). Devices whose share of a step is the same
    (ddp's and fsdp's replicas at one device count, say) are traced once."""
    data = build_data(cfg.data, cfg.seed)
    sizes = model_sizes(cfg, data)
    traces: dict[tuple, TracedShare] = {}
    plans = []
    started = time.perf_counter()
    for index, parallel in enumerate(parallels, 1):
        plans.append(plan_one(cfg, parallel, data, sizes, traces, speed))
        if progress:
            progress(
                f"planned {parallel.name} on {parallel.devices} device(s) "
                f"({index}/{len(parallels)}, {time.perf_counter() - started:.0f} s)"
            )
    return plans


def plan_one(
    cfg: DictConfig,
    parallel: DictConfig,
    data: Data,
    sizes: ModelSizes,
    traces: dict[tuple, TracedShare] | None = None,
    speed: DeviceSpeed | None = None,
) -> Plan:
    """`parallel`'s plan; `traces` holds the shares traced so far, by `share_key`."""
    plan = Plan(parallel.name, parallel.devices, parallel)
    trainer = cfg.trainer
    traces = {} if traces is None else traces
    try:
        strategy = build_strategy(parallel, planned_device_type(cfg), trainer.precision)
        strategy.check_batch(trainer.batch_size // trainer.accumulate)
        strategy.check_accumulate(trainer.accumulate)
        strategy.check_model(*meta_model_and_inputs(cfg, data, 2))
    except ConfigError as error:
        plan.problem = str(error)
        return plan
    micro_batch = trainer.batch_size // trainer.accumulate
    shares = strategy.device_shares(sizes, micro_batch)
    eval_batch = min(typed(TrainerConfig, trainer).eval_batch, len(data.val))  # the largest
    eval_shares = strategy.device_shares(sizes, eval_batch)
    for share, eval_share in zip(shares, eval_shares, strict=True):
        key = (share_key(share), share_key(eval_share))
        if key not in traces:
            traces[key] = trace_share(cfg, data, share, eval_share)
        plan.device_plans.append(device_plan(traces[key], share, eval_share))
    plan.traffic = strategy.step_traffic(sizes, micro_batch, trainer.accumulate)
    plan.fits = plan.needed <= cfg.plan.device_memory_gb * 2**30
    speed = speed or measured_speed(strategy.device_type, cfg.plan)
    plan.step_time_s = step_time_s(plan, strategy, speed, usable_cores())
    return plan


def planned_device_type(cfg: DictConfig) -> str:
    """cpu or cuda: `plan.accelerator`, or where the run would train."""
    if cfg.plan.accelerator != Accelerator.auto:
        return cfg.plan.accelerator.value
    return resolve_device_type(cfg.trainer.accelerator)


class DeviceSpeed:
    """What the predicted step time takes a device to do: FLOP/s at a number of intra-op
    threads, and bytes/s sent between processes (`link`) and within one (`copy`). This one
    takes them from the settings (`plan.device_tflops`, `plan.link_gb_per_s`): GPUs, which the
    planner need not see."""

    def __init__(self, settings: DictConfig):
        self.settings = settings

    def flops_per_s(self, threads: int) -> float:
        return self.settings.device_tflops * 1e12

    def link_bytes_per_s(self) -> float:
        return self.settings.link_gb_per_s * 1e9

    def copy_bytes_per_s(self) -> float:
        return self.link_bytes_per_s()

    def describe(self) -> str:
        return (
            f"step times at {self.settings.device_tflops:g} TFLOP/s per device "
            f"(plan.device_tflops), {self.settings.link_gb_per_s:g} GB/s between devices "
            "(plan.link_gb_per_s)"
        )


class MeasuredCPU(DeviceSpeed):
    """This machine's CPU, measured (each figure once, in well under a second): a CPU 'device'
    is no chip of its own but a share of the cores, so the rate to plan with is what a matmul
    reaches on the threads a process gets; processes talk over loopback sockets (gloo), a
    process's devices through its own memory."""

    MATMUL = (256, 512, 512)  # m, k, n: a layer's work at a small batch
    SENT_BYTES = 8 * MB

    def __init__(self) -> None:
        self.figures: dict[str, float] = {}

    def measured(self, name: str, measure: Callable[[], float]) -> float:
        if name not in self.figures:
            self.figures[name] = measure()
        return self.figures[name]

    def flops_per_s(self, threads: int) -> float:
        return self.measured(f"flops/{threads}", lambda: matmul_flops_per_s(self.MATMUL, threads))

    def link_bytes_per_s(self) -> float:
        return self.measured("link", lambda: socket_bytes_per_s(self.SENT_BYTES))

    def copy_bytes_per_s(self) -> float:
        return self.measured("copy", lambda: copy_bytes_per_s(self.SENT_BYTES))

    def describe(self) -> str:
        rates = sorted(
            (int(name.split("/")[1]), rate)
            for name, rate in self.figures.items()
            if name.startswith("flops/")
        )
        flops = ", ".join(
            f"{rate / 1e9:.3g} GFLOP/s on {threads} thread(s)" for threads, rate in rates
        )
        moved = [
            f"{label} {self.figures[name] / 1e9:.3g} GB/s"
            for name, label in (("link", "loopback socket"), ("copy", "memory copy"))
            if name in self.figures
        ]
        return f"step times from this CPU, measured now: {', '.join([flops, *moved])}"


@functools.cache
def measured_cpu() -> MeasuredCPU:
    """This process's measurements of the CPU (one set, shared by every plan)."""
    return MeasuredCPU()


def measured_speed(device_type: str, settings: DictConfig) -> DeviceSpeed:
    """The speed to plan `device_type` with: the CPU measured, GPUs from the settings."""
    return measured_cpu() if device_type == "cpu" else DeviceSpeed(settings)


def best_time_s(work: Callable[[], Any], repeats: int = 5) -> float:
    """The shortest of `repeats` timed runs of `work` (after one untimed): the machine's speed,
    not what else it ran meanwhile."""
    work()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def matmul_flops_per_s(shape: tuple[int, int, int], threads: int) -> float:
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return 2 * m * k * n / best_time_s(lambda: a @ b)
    finally:
        torch.set_num_threads(previous)


def copy_bytes_per_s(size: int) -> float:
    source = torch.empty(size // 4)
    target = torch.empty_like(source)
    return size / best_time_s(lambda: target.copy_(source))


def socket_bytes_per_s(size: int) -> float:
    """Bytes/s through a loopback TCP connection, sent by one thread, read by another."""
    payload = bytes(size)
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
        with sender, receiver:
            buffer = bytearray(size)

            def send_and_read() -> None:
                thread = threading.Thread(target=sender.sendall, args=(payload,))
                thread.start()
                view, received = memoryview(buffer), 0
                while received < size:
                    received += receiver.recv_into(view[received:])
                thread.join()

            return size / best_time_s(send_and_read, repeats=3)


def step_time_s(plan: Plan, strategy: PlannedStrategy, speed: DeviceSpeed, cores: int) -> float:
    """A rough time per step: compute, plus the step's traffic, not overlapped.

    GPUs run side by side: the busiest device's FLOPs, stretched by a pipeline's idle share.
    On CPU a one-process strategy's devices (see `DeviceShare.devices`) share its cores, so they
    run one after another: all their FLOPs at the rate of its threads. Each device of a
    strategy of several processes is a process, the cores split over them: the busiest one's
    FLOPs at its threads' rate, stretched by the idle share where its pipeline's stages are
    processes of their own (not several stages in one process, `devices` > 1). Traffic between
    processes goes over the link; within one process (every device of a one-process strategy)
    it is a copy in memory."""
    processes = strategy.processes_per_node
    if strategy.device_type == "cpu" and processes == 1:
        compute = sum(device.flops for device in plan.device_plans) / speed.flops_per_s(cores)
    elif strategy.device_type == "cpu":
        busiest = max(plan.device_plans, key=lambda device: device.flops)
        idle = strategy.idle_fraction() if busiest.devices == 1 else 0.0
        compute = busiest.flops / speed.flops_per_s(max(1, cores // processes)) / (1 - idle)
    else:
        busiest = max(device.flops / device.devices for device in plan.device_plans)
        compute = busiest / speed.flops_per_s(1) / (1 - strategy.idle_fraction())
    rate = speed.link_bytes_per_s() if processes > 1 else speed.copy_bytes_per_s()
    return compute + sum(plan.traffic.values()) / rate


def meta_model_and_inputs(cfg: DictConfig, data: Data, samples: int) -> tuple[nn.Module, Any]:
    """The model on the meta device and `samples` samples' meta inputs."""
    with torch.device("meta"):
        model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    inputs, _ = first_samples(data.train, 2)
    shape = (samples, *inputs.shape[1:])
    return model, torch.empty(shape, dtype=inputs.dtype, device="meta")


def model_sizes(cfg: DictConfig, data: Data) -> ModelSizes:
    """Bytes per block (parameters) and per sample (inputs, each block's output), from the model
    run on the meta device."""
    model, inputs = meta_model_and_inputs(cfg, data, 1)
    outputs, value = [], inputs
    with torch.no_grad():
        for block in model:
            value = block(value)
            outputs.append(sum(leaf.nbytes for leaf in tree_leaves(value) if torch.is_tensor(leaf)))
    seen: set[int] = set()
    block_parameters = []
    for block in model:
        owned = [p for p in block.parameters() if id(p) not in seen]  # a tied one counts once
        seen.update(id(p) for p in owned)
        block_parameters.append(sum(p.nbytes for p in owned))
    return ModelSizes(
        block_parameter_bytes=block_parameters,
        input_bytes=inputs.nbytes,
        block_output_bytes=outputs,
        shared_blocks=tied_block_groups(model),
    )


@dataclass(frozen=True)
class TracedShare:
    """What tracing a share found: its peaks by MemTracker's categories, while the model runs
    and at the optimizer step (`RUNNING`, `STEPPING`), and while it evaluates one batch; its
    FLOPs per optimizer step."""

    peaks: dict[str, dict[Any, int]]
    flops: int
    evaluation: dict[Any, int]


def share_key(share: DeviceShare) -> tuple:
    """What a share's trace depends on: shares equal in these trace the same (the label, the
    sharding and what the strategy adds are applied after, in `device_plan`)."""
    return (
        share.samples,
        share.blocks,
        share.later_stages,
        share.parts,
        share.gather,
        share.replica_only,
    )


def trace_share(
    cfg: DictConfig, data: Data, share: DeviceShare, eval_share: DeviceShare
) -> TracedShare:
    """`share`'s part of two training steps on fake tensors, then `eval_share`'s part of one
    evaluation batch. The first step creates the optimizer state and counts the FLOPs (apart
    from the tracker: under FlopCounterMode, checkpointed activations stay alive); the second,
    tracked by MemTracker with that state held, gives the peaks by category (the first step's
    are never higher: it holds no optimizer state). The evaluation runs as the loop's does: the
    model in eval mode, under no_grad, beside the optimizer state (the gradients are gone)."""
    trainer = cfg.trainer
    task = instantiate(cfg.task)
    sample_inputs, sample_targets = first_samples(data.train, 1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
        prepare_blocks(model, trainer.activation_checkpointing, False)
        ranges = share.stage_blocks(len(model))
        stages = nn.ModuleList(nn.Sequential(*list(model)[start:end]) for start, end in ranges)
        optimizer = build_optimizer(cfg.optimizer, stages.parameters())
        lasts = [end == len(model) for _, end in ranges]
        step = ShareStep(stages, share, task, lasts)
        templates = [
            stage_inputs(model, start, share.samples, sample_inputs) for start, _ in ranges
        ]
        eval_step = ShareStep(stages, eval_share, task, lasts)
        eval_templates = [
            stage_inputs(model, start, eval_share.samples, sample_inputs) for start, _ in ranges
        ]

        def training_step() -> None:
            for _ in range(trainer.accumulate):
                inputs = [
                    fresh_inputs(template, from_stage=start > 0)
                    for template, (start, _) in zip(templates, ranges, strict=True)
                ]
                targets = sample_targets.new_zeros(share.samples, *sample_targets.shape[1:])
                with autocast("cpu", trainer.precision):
                    loss = step(inputs, targets)
                loss.backward()
            if not share.replica_only:  # a replica's gradients go to the output device
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def evaluation_batch() -> None:
            inputs = [fresh_inputs(template, from_stage=False) for template in eval_templates]
            targets = sample_targets.new_zeros(eval_share.samples, *sample_targets.shape[1:])
            stages.eval()
            with torch.no_grad(), autocast("cpu", trainer.precision):
                eval_step(inputs, targets)
            stages.train()

        with FlopCounterMode(display=False) as flops:
            training_step()
        tracker = StepMemTracker()
        tracker.track_external(step, optimizer)
        with tracker:
            training_step()
        # Where MemTracker's internals recorded no phases (another torch's), its whole-step
        # peak, taken as the model's: what the strategy holds while it runs is added to it.
        (whole_step,) = tracker.get_tracker_snapshot("peak").values()
        peaks = dict(tracker.phase_peaks) or {RUNNING: dict(whole_step)}
        with tracker:  # entered again: its peak starts again from what is alive
            evaluation_batch()
        (evaluation,) = tracker.get_tracker_snapshot("peak").values()
    return TracedShare(peaks, flops.get_total_flops(), dict(evaluation))


def device_plan(traced: TracedShare, share: DeviceShare, eval_share: DeviceShare) -> DevicePlan:
    """`share`'s device at the higher of its traced peaks, each in the plan's categories,
    shared out, with what the strategy adds while the model runs (`share.running_bytes`) on
    the one taken then; and its evaluation's peak (`eval_share`'s)."""
    flops = int(traced.flops * share.flops_kept)
    devices = [
        shared_out(in_categories(peak, share, flops), share, running=phase == RUNNING)
        for phase, peak in traced.peaks.items()
    ]
    device = max(devices, key=lambda device: device.peak)
    device.evaluation = evaluation_peak(traced.evaluation, eval_share)
    return device


def evaluation_peak(peak: dict[Any, int], share: DeviceShare) -> int:
    """A traced evaluation peak (by MemTracker's categories) shared out as `share`'s device,
    with what the strategy adds while the model runs forward alone (`share.forward_bytes`)."""
    device = shared_out(in_categories(peak, share, flops=0), share, running=False)
    return device.peak + sum(share.forward_bytes.values())


def in_categories(peak: dict[Any, int], share: DeviceShare, flops: int) -> DevicePlan:
    """A traced peak (by MemTracker's categories) as `share`'s device, in the plan's."""
    device = DevicePlan(share.label, share.devices, flops=flops)
    for kind, size in peak.items():
        if kind in TRACKED_AS:
            name = TRACKED_AS[kind]
            setattr(device, name, getattr(device, name) + size)
    return device


def shared_out(device: DevicePlan, share: DeviceShare, running: bool) -> DevicePlan:
    """`device` with its parameters, gradients and optimizer state cut to `share.state_kept`
    and split `share.state_shards` ways, its activations cut to `share.activations_kept`, plus
    what the strategy adds on top (`share.extra_bytes`; `share.running_bytes` too if the model
    is `running`)."""
    split = {
        name: int(getattr(device, name) * share.state_kept) // share.state_shards
        for name in ("parameters", "gradients", "optimizer")
    }
    split["activations"] = int(device.activations * share.activations_kept)
    if share.replica_only:
        split.update(gradients=0, optimizer=0)
    device = dataclasses.replace(device, **split)
    running_bytes = share.running_bytes if running else {}
    for name, size in [*share.extra_bytes.items(), *running_bytes.items()]:
        setattr(device, name, getattr(device, name) + size)
    return device


def stage_inputs(
    model: nn.Sequential, start: int, samples: int, sample_inputs: torch.Tensor
) -> Any:
    """What block `start` takes for `samples` samples (fake): the data, or (before tracking
    starts) the previous blocks' output, as a template for `fresh_inputs`."""
    inputs = sample_inputs.new_zeros(samples, *sample_inputs.shape[1:])
    if start == 0:
        return inputs
    with torch.no_grad():
        return nn.Sequential(*list(model)[:start])(inputs)


def fresh_inputs(template: Any, from_stage: bool) -> Any:
    """A new micro-batch shaped like `template`; a previous stage's activations (`from_stage`)
    arrive needing the gradient this stage sends back."""

    def fresh(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(tensor).requires_grad_(from_stage and tensor.is_floating_point())

    return tree_map(fresh, template)


class ShareStep(nn.Module):
    """A device's forward pass and loss: what it backpropagates, over each of its stages (one,
    unless an interleaved pipeline gives it several), all of them kept for one backward."""

    def __init__(self, stages: nn.ModuleList, share: DeviceShare, task: Any, lasts: list[bool]):
        super().__init__()
        self.stages, self.share, self.task, self.lasts = stages, share, task, lasts

    def forward(self, inputs: list[Any], targets: torch.Tensor) -> torch.Tensor:
        pairs = zip(self.stages, inputs, self.lasts, strict=True)
        return sum(self.stage_loss(stage, x, targets, last) for stage, x, last in pairs)

    def stage_loss(
        self, stage: nn.Sequential, inputs: Any, targets: torch.Tensor, last: bool
    ) -> torch.Tensor:
        """The loss sum (over `share.parts` parts, their outputs concatenated first when
        `share.gather`), or, before the last stage, its outputs' sum (whose gradient stands for
        the one the next stage sends back)."""
        parts = [stage(part) for part in split_parts(inputs, self.share.parts)]
        if not last:
            return sum(leaf.float().sum() for part in parts for leaf in tree_leaves(part))
        if self.share.gather:
            return self.task.sums(torch.cat(parts), targets)[0]
        target_parts = targets.tensor_split(len(parts))
        pairs = zip(parts, target_parts, strict=True)
        return sum(self.task.sums(out, tgt)[0] for out, tgt in pairs)


def split_parts(inputs: Any, parts: int) -> list[Any]:
    leaves, spec = tree_flatten(inputs)
    chunks = [leaf.tensor_split(parts) for leaf in leaves]
    return [tree_unflatten([c[i] for c in chunks], spec) for i in range(parts)]


# ----------------------------------------------------------------------------------------- table


def format_table(plans: Sequence[Plan], device_memory_gb: float, brief: bool = False) -> str:
    """The plans as a text table, one row per device of each plan, MB; `brief` names the plans
    that cannot run in one line at the end instead of a row each with the reason."""
    header = (
        f"{'strategy':<15}{'devices':>8}  {'device':<12}{'params':>9}{'grads':>9}{'optim':>9}"
        f"{'activ':>9}{'peak MB':>10}{'eval peak MB':>14}{'traffic MB':>12}{'fits':>6}"
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
                f"{device.evaluation / MB:>14.2f}"
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
    """The plan with the shortest predicted step among those that fit, and why, in one line."""
    runnable = [plan for plan in plans if plan.problem is None]
    fitting = [plan for plan in runnable if plan.fits]
    if not fitting:
        smallest = min(runnable, key=lambda plan: plan.needed, default=None)
        need = f"; the smallest needs {smallest.needed / MB:.0f} MB per device" if smallest else ""
        raise ConfigError(
            f"no strategy fits plan.device_memory_gb{need}; raise plan.device_memory_gb or "
            "parallel.devices, or lower trainer.batch_size (or trainer.eval_batch_size)"
        )
    best = min(fitting, key=lambda plan: plan.step_time_s)
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
