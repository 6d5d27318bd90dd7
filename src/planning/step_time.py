"""The predicted time of a step: what a device computes (its matmuls' FLOPs at the measured
rate of their size, its other ops' bytes at memory's rate, plus a fixed cost per op: launch and
dispatch) and the messages it waits for (latency plus bytes over bandwidth, each collective's
own, plus what the wrapper that sends it costs beyond that), from this machine's calibration
(`calibration.py`) or, for GPUs the planner does not see, the settings (`plan.device_tflops`,
`plan.link_gb_per_s`)."""

from __future__ import annotations

import functools
import math

import torch

from src.config.plan import PlanConfig
from src.parallel.base import CostModel, PlannedStrategy
from src.parallel.shares import Messages
from src.planning.calibration import Calibration, calibration
from src.planning.plans import DevicePlan, Plan

# The share of a step's compute that is backward, behind which DDP's bucketed all-reduce and
# FSDP's prefetched gathers and reduce-scatters run (backward costs about twice the forward).
BACKWARD_SHARE = 2 / 3


class DeviceSpeed:
    """What the predicted step time takes a device to do: FLOP/s and seconds per op at a
    number of intra-op threads, a message's seconds, and bytes/s copied within a process. This
    one takes them from the settings (`plan.device_tflops`, `plan.link_gb_per_s`; no latency):
    GPUs the planner does not see."""

    overlaps = True
    """Whether messages run beside compute: a GPU's collectives have engines and streams of
    their own; gloo's threads on CPU take turns on the cores the compute runs on."""

    def __init__(self, settings: PlanConfig):
        self.settings = settings

    def compute_s(self, device: DevicePlan, threads: int) -> float:
        """`device`'s work (`DevicePlan`) at `threads`: its matmuls' FLOPs at the rates of
        their sizes, its other ops' bytes at memory's rate, each op's own cost, and DTensor's
        dispatch of its optimizer's ops and its layers on DTensors."""
        return (
            sum(
                flops / self.flops_per_s(threads, size)
                for size, flops in device.flops_by_size.items()
            )
            + device.moved_bytes / self.moved_bytes_per_s(threads)
            + device.ops * self.op_s(threads)
            + device.dtensor_ops * self.dtensor_op_s()
            + device.dtensor_layers * self.dtensor_layer_s()
        )

    def flops_per_s(self, threads: int, size: int) -> float:
        """A matmul's FLOP/s at `threads`, by its `work.size_class`."""
        return self.settings.device_tflops * 1e12

    def moved_bytes_per_s(self, threads: int) -> float:
        return math.inf

    def op_s(self, threads: int) -> float:
        return 0.0

    def dtensor_op_s(self) -> float:
        """An optimizer op's seconds on DTensors beyond its own cost."""
        return 0.0

    def dtensor_layer_s(self) -> float:
        """A tensor-parallel layer's seconds forward and backward beyond the plain layer's."""
        return 0.0

    def fixed_step_s(self, threads: int) -> float:
        """A training step's seconds beyond its ops and FLOPs."""
        return 0.0

    def message_s(self, messages: Messages, processes: int) -> float:
        """All of `messages`' seconds, in a job of `processes` processes."""
        return messages.count * messages.size / self.copy_bytes_per_s()

    def copy_bytes_per_s(self) -> float:
        return self.settings.link_gb_per_s * 1e9

    def describe(self) -> str:
        return (
            f"step times at {self.settings.device_tflops:g} TFLOP/s per device "
            f"(plan.device_tflops), {self.settings.link_gb_per_s:g} GB/s between devices "
            "(plan.link_gb_per_s), no latency"
        )


class CalibratedSpeed(DeviceSpeed):
    """This machine's devices, as calibrated (`calibration.Calibration`): on CPU a 'device' is
    no chip of its own but a share of the cores, so its rates are those at the threads a
    process gets."""

    def __init__(self, figures: Calibration):
        self.figures = figures
        self.overlaps = figures.device_type != "cpu"

    def flops_per_s(self, threads: int, size: int) -> float:
        return self.figures.matmul_flops_per_s_at(threads, size)

    def moved_bytes_per_s(self, threads: int) -> float:
        return self.figures.at_threads(self.figures.elementwise_bytes_per_s, threads)

    def op_s(self, threads: int) -> float:
        return self.figures.at_threads(self.figures.op_s, threads, best=min)

    def dtensor_op_s(self) -> float:
        return self.figures.dtensor_op_s

    def dtensor_layer_s(self) -> float:
        return self.figures.dtensor_layer_s

    def fixed_step_s(self, threads: int) -> float:
        return self.figures.at_threads(self.figures.step_s, threads, best=min)

    def message_s(self, messages: Messages, processes: int) -> float:
        figures = self.figures
        # A wrapper's cost is measured by the processes in the job, dp's by its replicas.
        among = max(processes, messages.ranks)
        each = figures.message_s(
            messages.collective, messages.ranks, messages.size, messages.wrapper, among
        )
        return messages.count * each

    def copy_bytes_per_s(self) -> float:
        return max(self.figures.elementwise_bytes_per_s.values())

    def describe(self) -> str:
        figures = self.figures
        rates = ", ".join(
            f"{min(by_size.values()) / 1e9:.3g}-{max(by_size.values()) / 1e9:.3g} GFLOP/s by "
            f"matmul size and {figures.op_s[threads] * 1e6:.3g} us/op on {threads} thread(s)"
            for threads, by_size in sorted(
                figures.matmul_flops_per_s.items(), key=lambda item: int(item[0])
            )
        )
        latency = figures.collectives["all_reduce"]
        ranks = min(latency, key=lambda count: (int(count) < 2, int(count)))  # 2 if measured
        wrappers = wrapper_costs(figures.wrappers, ranks)
        return (
            f"step times from this {figures.device_type.upper()}'s calibration ({rates}; "
            f"all-reduce on {ranks} processes {latency[ranks][0] * 1e6:.0f} us + "
            f"{1e-9 / max(latency[ranks][1], 1e-15):.3g} GB/s"
            + (f"; {wrappers}" if wrappers else "")
            + "; measured at load "
            f"{figures.load_per_core:.1f} per core; plan.calibrate=true measures again)"
        )


def wrapper_costs(wrappers: dict[str, dict[str, float]], processes: str) -> str:
    """The calibration's wrapper figures at `processes` in words: what a message of each
    wrapper adds to a step beyond its collective (below 0 where it ran faster than the bare
    collective alone), and dp's, which is no message's but its replicas' threads'."""
    by_message = [
        f"{wrapper} {by_processes[processes] * 1e6:.0f} us"
        for wrapper, by_processes in wrappers.items()
        if wrapper != "dp" and processes in by_processes
    ]
    said = []
    if by_message:
        said.append(
            "what a message adds to a step beyond its collective's latency (hooks, copies, "
            "waiting for peers; below 0 where it ran faster in the step, overlapped, than the "
            "bare collective measured alone): " + ", ".join(by_message)
        )
    if processes in wrappers.get("dp", {}):
        said.append(
            f"dp's {processes} replicas, run in threads of one process, add "
            f"{wrappers['dp'][processes] * 1e6:.0f} us to each micro-step"
        )
    return "; ".join(said)


@functools.cache
def calibrated_speed(device_type: str, refresh: bool) -> CalibratedSpeed:
    """This machine's calibrated speed (measured at most once per process when `refresh`)."""
    return CalibratedSpeed(calibration(device_type, refresh))


def measured_speed(device_type: str, settings: PlanConfig) -> DeviceSpeed:
    """The speed to plan `device_type` with: calibrated where this machine has it (the CPU, a
    visible GPU), else from the settings."""
    if device_type == "cpu" or torch.cuda.is_available():
        return calibrated_speed(device_type, settings.calibrate)
    return DeviceSpeed(settings)


def step_time_s(
    plan: Plan, strategy: PlannedStrategy, costs: CostModel, speed: DeviceSpeed, cores: int
) -> float:
    """The predicted time of a step: the busiest device's compute, stretched by its pipeline's
    idle share (`costs.idle_fraction`), plus the messages it waits for (`plan.messages`; those
    that run during backward only as far as they outlast it, where the device `overlaps`);
    within one process, traffic is a copy in memory.

    GPUs run side by side. On CPU a one-process strategy's devices (see `DeviceShare.devices`)
    share its cores, so they run one after another, at the rate of all its threads; each of
    several processes gets its share of the cores (more processes than cores take turns)."""
    processes = strategy.processes_per_node
    threads = max(1, cores // processes) if strategy.device_type == "cpu" else 1

    def compute_s(device: DevicePlan) -> float:
        return speed.compute_s(device, threads)

    # On CPU, more processes than cores take turns at all of a step's own work.
    turns = max(1.0, processes / cores) if strategy.device_type == "cpu" else 1.0
    if strategy.device_type == "cpu" and processes == 1:
        compute = sum(compute_s(device) for device in plan.device_plans)
    else:
        busiest = max(plan.device_plans, key=compute_s)
        share = compute_s(busiest) / (busiest.devices if strategy.device_type != "cpu" else 1)
        idle = costs.idle_fraction() if busiest.devices == 1 else 0.0
        compute = share * turns / (1 - idle)
    compute += speed.fixed_step_s(threads) * turns
    if processes == 1:
        copies = sum(plan.traffic.values()) / speed.copy_bytes_per_s()
        return compute + copies + sum(speed.message_s(m, processes) for m in plan.messages)
    exposed = sum(speed.message_s(m, processes) for m in plan.messages if not m.overlapped)
    hidden = sum(speed.message_s(m, processes) for m in plan.messages if m.overlapped)
    if not speed.overlaps:
        return compute + exposed + hidden
    return compute + exposed + max(0.0, hidden - BACKWARD_SHARE * compute)
