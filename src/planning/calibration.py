"""A short calibration of this machine, for the predicted step time: matmul and elementwise
throughput at the threads a process gets, the time each op costs beyond its arithmetic (launch
and dispatch: what dominates small models), and each collective's latency and bandwidth at a
few sizes and process counts (gloo on CPU, NCCL on CUDA). Measured once (a few seconds) and
cached per machine, device type, torch version and core count in a small JSON file,
`cache_path()` (`~/.cache/parallel-training-template/`, or under `$XDG_CACHE_HOME`); measured
again with `plan.calibrate=true`."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from src.parallel.devices import usable_cores
from src.parallel.shares import COLLECTIVES
from src.planning.timing import best_time_s, typical_time_s
from src.planning.work import WorkCounter, size_class
from src.planning.wrapper_costs import dtensor_costs_s, replica_threads_s, wrapper_message_s
from src.runtime.files import write_atomically
from src.runtime.forking import become_forked_child, start_rank_server

PROJECT = "parallel-training-template"
# m, k, n of matmuls from a small layer's to a large one's: a matmul's rate grows with its size
# (a GPU's far beyond a CPU's), and a model's rate is that at its own matmuls' sizes.
MATMULS = {
    "cpu": ((64, 64, 64), (128, 256, 256), (256, 512, 512)),
    "cuda": ((256, 256, 256), (1024, 1024, 1024), (4096, 4096, 4096)),
}
ELEMENTWISE = 2**20  # floats added in place: memory-bound, as optimizers and activations are
SIZES = (2**10, 2**20)  # bytes per message: latency, then bandwidth
PROCESS_COUNTS = (1, 2, 4)
CALMER = 0.5
VERSION = 9  # of the figures, in the cache's name: another version's are measured again


@dataclass
class Calibration:
    """This machine's figures. Thread counts and process counts are JSON keys (strings)."""

    device_type: str
    matmul_flops_per_s: dict[str, dict[str, float]]
    """By intra-op threads, then a call's `work.size_class`: FLOP/s beyond its op's own cost."""
    elementwise_bytes_per_s: dict[str, float]
    """By intra-op threads: bytes read and written by an in-place add."""
    step_s: dict[str, float]
    """By intra-op threads: a training step's fixed seconds, beyond its ops (the optimizer's
    Python, mostly)."""
    op_s: dict[str, float]
    """By intra-op threads: seconds per aten op beyond its arithmetic: dispatch, autograd,
    launch."""
    collectives: dict[str, dict[str, list[float]]]
    """By collective, then process count: [latency s, s per byte]."""
    wrappers: dict[str, dict[str, float]] = field(default_factory=dict)
    """By wrapper (ddp, fsdp, tp, pp), then processes in the job: the seconds a message it sends
    costs in a training step beyond its collective's latency, its own work and the waits
    (`wrapper_costs.py`; negative where the bare collective read slower); on CPU also dp, by
    replicas: a micro-step's cost of running them in threads of one process."""
    wrapper_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    """By wrapper (ddp), then processes in the job: the seconds per byte its message costs in a
    training step beyond the bare collective's (`wrapper_costs.wrapper_message_s`)."""
    dtensor_op_s: float = 0.0
    """The seconds an optimizer's op (as the planner's trace counts them) on DTensors costs
    beyond the same op on plain tensors (`wrapper_costs.dtensor_costs_s`; 0 where no job of
    processes ran: CUDA with one GPU)."""
    dtensor_layer_s: float = 0.0
    """The seconds a tensor-parallel layer's forward and backward cost beyond the plain
    layer's, in one process: DTensor's dispatch of its ops (`wrapper_costs.dtensor_costs_s`)."""
    seconds: float = 0.0
    """How long measuring took."""
    load_per_core: float = 0.0
    """The 1-minute load average per core as it began measuring."""

    def at_threads(self, figures: dict[str, float], threads: int, best: Callable = max) -> float:
        """A per-thread figure at `threads`: the `best` of those measured at up to `threads`
        (more threads never make a rate worse; under load a measurement can look as if)."""
        measured = [value for key, value in figures.items() if int(key) <= threads]
        return best(measured or [figures[min(figures, key=int)]])

    def matmul_flops_per_s_at(self, threads: int, size: int) -> float:
        """The FLOP/s of a matmul of `size` class at `threads`: interpolated between the sizes
        measured (by their classes), the end's beyond them; the best of the thread counts
        measured up to `threads` (`at_threads`)."""
        at_size = {
            key: interpolated({int(each): rate for each, rate in rates.items()}, size)
            for key, rates in self.matmul_flops_per_s.items()
        }
        return self.at_threads(at_size, threads)

    def message_s(
        self, collective: str, ranks: int, size: int, wrapper: str = "", processes: int = 0
    ) -> float:
        """One message's seconds among `ranks` of a job of `processes`: latency plus bytes
        over bandwidth, at the nearest `ranks` measured (below where there is one), plus the
        `wrapper`'s cost of a message and of a byte beyond those, at the nearest `processes`
        measured (together never negative)."""
        latency, per_byte = nearest(self.collectives[collective], ranks) if collective else (0, 0)
        beyond = nearest(self.wrappers[wrapper], processes) if self.wrappers.get(wrapper) else 0.0
        if self.wrapper_bytes.get(wrapper):
            per_byte = max(0.0, per_byte + nearest(self.wrapper_bytes[wrapper], processes))
        return max(0.0, latency + beyond) + size * per_byte


def interpolated(by_size: dict[int, float], size: int) -> float:
    """`by_size`'s figure at `size`: linear between the two sizes around it, else the nearest."""
    sizes = sorted(by_size)
    if size <= sizes[0] or size >= sizes[-1]:
        return by_size[sizes[0] if size <= sizes[0] else sizes[-1]]
    below = max(each for each in sizes if each <= size)
    above = min(each for each in sizes if each > size)
    share = (size - below) / (above - below)
    return by_size[below] + share * (by_size[above] - by_size[below])


def nearest(by_count: dict[str, Any], count: int) -> Any:
    """The figure measured at the largest count up to `count` (else at the smallest)."""
    measured = sorted(int(key) for key in by_count)
    below = [each for each in measured if each <= count] or measured[:1]
    return by_count[str(below[-1])]


def cache_path(device_type: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = f"{socket.gethostname()}-{device_type}-torch{torch.__version__}-{usable_cores()}cores"
    return base / PROJECT / f"calibration-v{VERSION}-{key}.json"


def calibration(device_type: str, refresh: bool = False) -> Calibration:
    """The cached calibration of `device_type` on this machine, measured now if there is none,
    or `refresh`, or the machine is calmer now than when it was measured (by over `CALMER`
    runnable processes per core: a loaded machine's figures are slower than its own)."""
    path = cache_path(device_type)
    if path.exists() and not refresh:
        cached = Calibration(**json.loads(path.read_text()))
        if cached.load_per_core <= load_per_core() + CALMER:
            return cached
    measured = calibrate(device_type)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole: processes planning at once (a sweep's jobs, test workers) read either the
    # old file or the new one, never half of one.
    text = json.dumps(dataclasses.asdict(measured), indent=1)
    write_atomically(path, lambda staging: staging.write_text(text))
    return measured


def calibrate(device_type: str) -> Calibration:
    """Measure this machine's figures (`Calibration`) for `device_type`."""
    started, load = time.perf_counter(), load_per_core()  # the load before its own work
    cores = usable_cores()
    device = torch.device(device_type)
    thread_counts = sorted({max(1, cores // processes) for processes in (1, 2, 4, 8, cores)})
    matmul, elementwise, step, op = {}, {}, {}, {}
    for threads in thread_counts:
        with intra_op_threads(threads):
            step[str(threads)], op[str(threads)] = step_and_op_s(device)
            matmul[str(threads)] = matmul_flops_per_s(device, op[str(threads)])
            elementwise[str(threads)] = elementwise_bytes_per_s(device)
    between_processes = process_figures(device_type)
    wrappers = between_processes["wrappers"]
    if device_type == "cpu":
        with intra_op_threads(cores):
            wrappers["dp"] = replica_threads_s(device)
    return Calibration(
        device_type,
        matmul,
        elementwise,
        step,
        op,
        between_processes["collectives"],
        wrappers,
        between_processes["wrapper_bytes"],
        between_processes["dtensor"]["op"],
        between_processes["dtensor"]["layer"],
        seconds=time.perf_counter() - started,
        load_per_core=load,
    )


def load_per_core() -> float:
    """The 1-minute load average per usable core."""
    return os.getloadavg()[0] / usable_cores()


class intra_op_threads:  # noqa: N801 - used as a context manager
    def __init__(self, threads: int):
        self.threads, self.previous = threads, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.threads)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.previous)


def matmul_flops_per_s(device: torch.device, op_s: float) -> dict[str, float]:
    """By `work.size_class`: each of `MATMULS`' FLOP/s beyond `op_s`, an op's own cost (which
    the step time counts apart, for every op)."""
    rates = {}
    for m, k, n in MATMULS[device.type]:
        a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
        seconds = best_time_s(lambda a=a, b=b: a @ b, device, repeats=5)
        flops = 2 * m * k * n
        rates[str(size_class(flops))] = flops / max(seconds - op_s, seconds / 10)
    return rates


def elementwise_bytes_per_s(device: torch.device) -> float:
    x, y = torch.zeros(ELEMENTWISE, device=device), torch.ones(ELEMENTWISE, device=device)
    return 3 * x.nbytes / best_time_s(lambda: x.add_(y), device, repeats=5)


def step_and_op_s(device: torch.device) -> tuple[float, float]:
    """(seconds per step, seconds per aten op) of a tiny model's training step (forward, loss,
    backward, SGD's step, zero_grad), whose arithmetic is next to nothing, from two depths: a
    step's fixed cost (the optimizer's Python, mostly) and each op's (dispatch, autograd,
    launch)."""
    shallow, deep = tiny_step_s_and_ops(device, 2), tiny_step_s_and_ops(device, 10)
    per_op = max(0.0, (deep[0] - shallow[0]) / (deep[1] - shallow[1]))
    return max(0.0, shallow[0] - shallow[1] * per_op), per_op


def tiny_step_s_and_ops(device: torch.device, depth: int) -> tuple[float, int]:
    """A training step's seconds and aten ops, for an MLP of `depth` 16-wide Linears."""
    torch.manual_seed(0)
    layers = [module for _ in range(depth) for module in (nn.Linear(16, 16), nn.ReLU())]
    model = nn.Sequential(*layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs, targets = torch.randn(8, 16, device=device), torch.randn(8, 16, device=device)

    def step() -> None:
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    counter = WorkCounter()
    with counter:
        step()
    return best_time_s(step, device, repeats=20), counter.ops


def process_figures(device_type: str) -> dict[str, dict]:
    """`collectives`: each collective's [latency, s per byte] at each of `PROCESS_COUNTS`
    processes (the largest in one job of that many processes, the others in groups of its
    first ranks); `wrappers`: each wrapper's seconds per message at each (`wrapper_costs`);
    `dtensor`: DTensor's own costs in one process (`wrapper_costs.dtensor_costs_s`)."""
    world = max(PROCESS_COUNTS)
    if device_type == "cuda":
        world = min(world, torch.cuda.device_count())
        if world < 2:
            collectives = {name: {"2": [0.0, 0.0]} for name in COLLECTIVES}
            dtensor = {"op": 0.0, "layer": 0.0}
            return {
                "collectives": collectives,
                "wrappers": {},
                "wrapper_bytes": {},
                "dtensor": dtensor,
            }
    server = start_rank_server()  # its forks import nothing: seconds sooner than interpreters
    forkserver = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory() as folder:
        results = Path(folder) / "collectives.json"
        arguments = (world, device_type, folder, str(results), server, dict(os.environ))
        ranks = [
            forkserver.Process(target=measure_collectives, args=(rank, *arguments))
            for rank in range(world)
        ]
        try:
            for process in ranks:
                process.start()
            for process in ranks:
                process.join(timeout=120)
        finally:
            for process in ranks:
                if process.is_alive():
                    process.kill()
        if any(process.exitcode != 0 for process in ranks):
            raise RuntimeError("the calibration's collectives failed (see their errors above)")
        return json.loads(results.read_text())


def measure_collectives(
    rank: int,
    world: int,
    device_type: str,
    folder: str,
    results: str,
    server_pid: int | None,
    environment: dict[str, str],
) -> None:
    """One rank's part of `process_figures`, forked by the rank server (`server_pid`) for a
    process of `environment`: rank 0 writes the figures to `results`."""
    become_forked_child(server_pid, environment)
    # torch 2.14 renamed the tensor collectives (the old names warn); torch 2.11 has only those.
    warnings.filterwarnings("ignore", category=FutureWarning)
    # Under fsdp x tp the tiny model's output is a view (DTensor's local tensor): FSDP2 warns of
    # in-place ops on it, which its step never makes.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(max(1, usable_cores() // world))
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"file://{folder}/store", rank=rank, world_size=world
    )
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in COLLECTIVES}
    wrappers: dict[str, dict[str, float]] = {}
    wrapper_bytes: dict[str, dict[str, float]] = {}
    try:
        for ranks in [count for count in PROCESS_COUNTS if count <= world]:
            group = dist.new_group(list(range(ranks)))
            for name in COLLECTIVES:
                if name == "send" and ranks != 2:
                    continue  # point to point is two processes at any size of job
                if rank < ranks:
                    times = [collective_s(name, size, ranks, rank, group, device) for size in SIZES]
                    figures[name][str(ranks)] = latency_and_per_byte(times)
                dist.barrier()
        latencies = {
            ranks: {name: by[str(ranks)][0] for name, by in figures.items() if str(ranks) in by}
            for ranks in PROCESS_COUNTS
        }
        alone = dist.new_group([0])  # rank 0 measures, the others wait
        dtensor = [None]
        if rank == 0:
            dtensor = [dtensor_costs_s(DeviceMesh.from_group(alone, device.type), device)]
        dist.broadcast_object_list(dtensor, src=0)
        slopes = {int(ranks): slope for ranks, (_, slope) in figures["all_reduce"].items()}
        layer_s = dtensor[0]["layer"]
        for processes in [count for count in PROCESS_COUNTS if count <= world]:
            costs = wrapper_message_s(rank, processes, device, latencies, layer_s, slopes)
            for found, by_wrapper in zip((wrappers, wrapper_bytes), costs, strict=True):
                for wrapper, seconds in by_wrapper.items():
                    found.setdefault(wrapper, {})[str(processes)] = seconds
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        found = {
            "collectives": figures,
            "wrappers": wrappers,
            "wrapper_bytes": wrapper_bytes,
            "dtensor": dtensor[0],
        }
        Path(results).write_text(json.dumps(found))


def latency_and_per_byte(times: list[float]) -> list[float]:
    """[latency, s per byte] from the times at `SIZES` (the slope never below zero)."""
    small, large = SIZES
    return [times[0], max(0.0, (times[1] - times[0]) / (large - small))]


def collective_s(
    name: str, size: int, ranks: int, rank: int, group: Any, device: torch.device
) -> float:
    """The seconds one `name` of `size` bytes takes among `ranks` processes, on this rank."""
    floats = size // 4
    whole = torch.ones(floats, device=device)
    part = torch.ones(floats // ranks, device=device)
    operations: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(whole, group=group),
        "all_gather": lambda: dist.all_gather_into_tensor(whole, part, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole, group=group),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(whole), whole, group=group),
        "send": lambda: (dist.send if rank == 0 else dist.recv)(whole, 1 - rank, group=group),
    }
    # The typical round, not the best: a step pays each message's usual wait, and on a CPU a
    # message's is heavy-tailed (a woken peer may wait for a core), far above the best round.
    # A large message's own time is long beside its wait: fewer of them time it as well.
    repeats = 10 if size == SIZES[0] else 4
    return typical_time_s(operations[name], device, repeats, lambda: dist.barrier(group=group))
