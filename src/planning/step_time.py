"""The predicted time of a step: what a device computes and sends, at the speed measured on
this CPU or given for GPUs (`plan.device_tflops`, `plan.link_gb_per_s`)."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig

from src.parallel.base import PlannedStrategy
from src.planning.plans import MB, Plan


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
