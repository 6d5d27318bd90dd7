"""The calibration's cost of a message as each wrapper sends it in a training step: DDP's reducer
(its hooks, the bucket copies), FSDP2's units (pre- and post-hooks, the all-gather's copy-in and
copy-out), tensor parallel's pairs and the 1F1B schedule (its stages' own work). A bare
collective's best time misses all of that, and the wait for a peer that is not there yet. The
figure is what a message costs beyond its collective's latency: a training step of a tiny model
under the wrapper, less the same step unwrapped and less the latencies of the collectives it
sent, over the messages. Measured in the calibration's job of processes
(`calibration.measure_collectives`) within 1 of them, among 2 and among 4: DDP over all 4, as
ddp 4 runs; the others in groups of 2 (fsdp and tp together on a 2 x 2 mesh, as fsdp 2 x tp 2
runs). Within one process only DDP and FSDP, which still run their hooks and copies there (ddp
and fsdp on one device), wait for no peer.

DTensor's own costs in one process (`dtensor_costs_s`: an optimizer's op, a tp layer) are
measured apart, and the planner counts them where they run: tp's figure is measured beyond its
layers'. (The steps' SGD, one op per tensor, runs on DTensors under fsdp and tp: its dispatch
stays in their figures, a few hundredths of a millisecond a message.)"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from src.components.optimizer import adamw
from src.parallel.devices import usable_cores
from src.parallel.pp.schedules import apply_pp
from src.parallel.replicas.apply import DataParallel
from src.planning.timing import best_times_s, typical_time_s, typical_times_s
from src.planning.work import WorkCounter

BLOCKS = 4  # a small model's depth: the wrapper's fixed cost spread over about as many units
WIDTH = 16  # next to no arithmetic: the step is the wrappers' work and the messages
SAMPLES = 8
BUCKET_WIDTH = 176  # a tiny model of about 1 MB of parameters: a real model's DDP bucket
MICROBATCHES = 2  # the pipeline's (parallel.microbatches' default)
REPEATS = 5  # steps a round: longer runs of back-to-back steps wait less than training steps do
# The wrappers take turns round by round: a message's wait swings from one second to the next
# on a CPU (docs/planner.md).
WRAPPER_ROUNDS = 9
# The collectives a rank sends per step of the tiny model: DDP one bucket; FSDP each block
# gathered for forward and again for backward and its gradients reduce-scattered; tp each pair's
# all-reduce forward and backward, but the first pair's backward (the model's input needs no
# gradient); pp, on 2 stages, a send or receive each way per micro-batch.
SENT = {
    "ddp": {"all_reduce": 1},
    "fsdp": {"all_gather": 2 * BLOCKS, "reduce_scatter": BLOCKS},
    "tp": {"all_reduce": 2 * BLOCKS - 1},
    "pp": {"send": 2 * MICROBATCHES},
}
GROUP = 2  # ranks per wrapper group
# dp's replicas on CPU: threads of one process, which contend for its cores' intra-op threads
# only where the ops are large enough to run in parallel, so a layer of the default MLP's width.
REPLICA_WIDTH, REPLICA_SAMPLES = 256, 32
REPLICA_COUNTS = (2, 4)


def tiny_model(device: torch.device, width: int = WIDTH) -> nn.Sequential:
    """`BLOCKS` blocks of a Colwise/Rowwise pair of Linears `width` wide."""
    torch.manual_seed(0)
    pairs = [
        nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        for _ in range(BLOCKS)
    ]
    return nn.Sequential(*pairs).to(device)


def parameter_bytes(width: int) -> int:
    """The tiny model's parameter bytes at `width`: DDP's one bucket."""
    return sum(p.nbytes for p in tiny_model(torch.device("meta"), width).parameters())


def loss_of(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).square().mean()


def training_step(model: nn.Module, inputs: torch.Tensor) -> Callable[[], None]:
    """One step of `model` on `inputs` (forward, loss, backward, SGD's step, zero_grad)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        loss_of(model(inputs), inputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def pipeline_step(mesh: DeviceMesh, device: torch.device) -> Callable[[], None]:
    """One step of the tiny model cut in two stages, one per rank of `mesh`, under 1F1B."""
    rank, half = mesh.get_local_rank(), BLOCKS // 2
    part = tiny_model(device)[rank * half : (rank + 1) * half]
    schedule, _ = apply_pp({rank: part}, mesh, device, "1F1B", MICROBATCHES, loss_of)
    optimizer = torch.optim.SGD(part.parameters(), lr=1e-3)
    inputs = torch.randn(SAMPLES, WIDTH, device=device)

    def step() -> None:
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=inputs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def wrapped_step(
    wrappers: tuple[str, ...],
    meshes: dict[str, DeviceMesh],
    device: torch.device,
    width: int = WIDTH,
) -> Callable[[], None]:
    """A training step of the tiny model `width` wide on `device` under `wrappers` (none:
    plain), each over its 1-D mesh in `meshes`."""
    if "pp" in wrappers:
        return pipeline_step(meshes["pp"], device)
    model = wrapped_model(wrappers, meshes, device, width)
    return training_step(model, torch.randn(SAMPLES, width, device=device))


def wrapped_model(
    wrappers: tuple[str, ...],
    meshes: dict[str, DeviceMesh],
    device: torch.device,
    width: int = WIDTH,
) -> nn.Module:
    """The tiny model `width` wide on `device` under `wrappers` other than pp, each over its
    1-D mesh in `meshes` (tp before fsdp, as the mesh layouts apply them)."""
    model = tiny_model(device, width)
    if "tp" in wrappers:
        model = parallelize_module(model, meshes["tp"], calibration_styles())
    if "fsdp" in wrappers:
        for block in model:
            fully_shard(block, mesh=meshes["fsdp"])
        fully_shard(model, mesh=meshes["fsdp"])
    if "ddp" in wrappers:
        model = DistributedDataParallel(model, process_group=meshes["ddp"].get_group())
    return model


def calibration_styles() -> dict[str, ParallelStyle]:
    """Each block of the tiny model a Colwise/Rowwise pair."""
    styles: dict[str, ParallelStyle] = {f"{block}.0": ColwiseParallel() for block in range(BLOCKS)}
    return styles | {f"{block}.2": RowwiseParallel() for block in range(BLOCKS)}


def steps_s(
    steps: list[Callable[[], None]], together: dist.ProcessGroup, device: torch.device
) -> list[float]:
    """Each of `steps`' seconds: the median of its rounds of `REPEATS` steps, the steps taking
    turns round by round (`timing.typical_times_s`), each round begun together by the ranks of
    `together`. The median, not the best: a training step's waits on its peers are those of a
    typical round."""
    barrier = functools.partial(dist.barrier, group=together)
    return typical_times_s(steps, device, [REPEATS] * len(steps), barrier, WRAPPER_ROUNDS)


def measured_together(processes: int) -> list[tuple[str, ...]]:
    """The wrappers timed in one step among `processes`: each alone in groups of `GROUP`;
    among `GROUP` x `GROUP`, fsdp and tp on one 2-D mesh, as fsdp 2 x tp 2 runs (a rank waits
    on peers in two groups); in one process those that run there."""
    if processes == 1:
        return [("ddp",), ("fsdp",)]
    if processes == GROUP * GROUP:
        return [("ddp",), ("pp",), ("fsdp", "tp")]
    return [(wrapper,) for wrapper in SENT]


def wrapper_message_s(
    rank: int,
    processes: int,
    device: torch.device,
    latencies: dict[int, dict[str, float]],
    tp_layer_s: float,
    all_reduce_s_per_byte: dict[int, float],
) -> tuple[dict[str, float], dict[str, float]]:
    """Each wrapper's seconds per message beyond its collective's latency (`latencies`: by
    ranks, then by collective) among `processes` processes, this one of rank `rank` (every
    rank of the world calls it, those beyond `processes` only to make the groups; they return
    nothing). DDP runs over all `processes`, as a ddp job all-reduces among all of its processes
    (their waits on each other grow with their number); the others in groups of `GROUP` (of
    one, in one process). Wrappers timed together share one figure. tp's steps less its layers'
    own cost (`tp_layer_s` each, `dtensor_costs_s`), which the planner counts by layer. Then by
    wrapper, the seconds per byte of its message beyond the bare collective's
    (`all_reduce_s_per_byte`, by ranks): DDP's, from its step again with a bucket of
    `BUCKET_WIDTH`'s model."""
    size = min(GROUP, processes)
    groups = [new_group(range(first, first + size)) for first in range(0, processes, size)]
    square = processes == GROUP * GROUP
    across = [new_group(range(first, processes, GROUP)) for first in range(GROUP)] if square else []
    together = new_group(range(processes))
    if rank >= processes:
        return {}, {}
    torch.set_num_threads(max(1, usable_cores() // processes))
    own = DeviceMesh.from_group(groups[rank // size], device.type)
    meshes = dict.fromkeys(SENT, own)
    meshes["ddp"] = DeviceMesh.from_group(together, device.type)
    ranks = {wrapper: size for wrapper in SENT} | {"ddp": processes}
    if square:
        grid = torch.arange(processes).view(GROUP, GROUP)
        dims = [across[rank % GROUP], groups[rank // GROUP]]
        mesh = DeviceMesh.from_group(dims, device.type, grid, mesh_dim_names=("dp", "tp"))
        meshes.update(fsdp=mesh["dp"], tp=mesh["tp"])
    # tp's layers cost their DTensor dispatch (`tp_layer_s`) with no message sent; with more
    # processes than cores, each in turns.
    layers_s = len(calibration_styles()) * tp_layer_s * max(1.0, processes / usable_cores())
    timed = measured_together(processes)
    steps = [wrapped_step(wrappers, meshes, device) for wrappers in [(), *timed]]
    bucket = [wrapped_step(wrappers, meshes, device, BUCKET_WIDTH) for wrappers in ((), ("ddp",))]
    plain, *wrapped, bucket_plain, bucket_ddp = steps_s([*steps, *bucket], together, device)
    beyond = {}
    for wrappers, step in zip(timed, wrapped, strict=True):
        own_s = layers_s if "tp" in wrappers else 0.0
        each = message_beyond_s(step - plain - own_s, wrappers, ranks, latencies)
        beyond.update(dict.fromkeys(wrappers, each))
    ddp_s = wrapped[timed.index(("ddp",))] - plain
    more = parameter_bytes(BUCKET_WIDTH) - parameter_bytes(WIDTH)
    per_byte = (bucket_ddp - bucket_plain - ddp_s) / more - all_reduce_s_per_byte[processes]
    return beyond, {"ddp": per_byte}


def message_beyond_s(
    seconds: float,
    wrappers: tuple[str, ...],
    ranks: dict[str, int],
    latencies: dict[int, dict[str, float]],
) -> float:
    """A message's seconds beyond its collective's latency, of `seconds` that `wrappers`' step
    took beyond the plain step (each wrapper's collectives among its `ranks`). Negative where
    the bare collective's rounds read slower than the step's messages (an unlucky round of
    sends): latency and figure together are what a message cost in the step."""
    sent = [(w, name, count) for w in wrappers for name, count in SENT[w].items()]
    bare = sum(count * latencies[ranks[w]].get(name, 0.0) for w, name, count in sent)
    return (seconds - bare) / sum(count for _, _, count in sent)


def new_group(ranks: range) -> dist.ProcessGroup:
    return dist.new_group(list(ranks))


def dtensor_costs_s(mesh: DeviceMesh, device: torch.device) -> dict[str, float]:
    """DTensor's own costs in one process (`mesh` of one rank: no peer, no message): `op`, the
    seconds an optimizer's op on DTensors costs beyond the same op on plain tensors (the
    template's AdamW over the tiny model's parameters sharded, less over plain ones, over the
    ops the planner's trace counts for it: its first step's, on the CPU, where AdamW updates
    one tensor at a time; on GPUs a fused step runs fewer); `layer`, a tp layer's forward and
    backward beyond the plain layer's (the tiny model's under tp less its plain one's, over its
    layers). Taking turns, the best of rounds: the machine's speed."""
    plain = [nn.Parameter(p.detach().clone()) for p in tiny_model(device).parameters()]
    split = [nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in plain]
    traced = [nn.Parameter(p.detach().cpu()) for p in plain]
    for parameter in (*plain, *split, *traced):
        parameter.grad = torch.ones_like(parameter)
    plain_step, split_step = (adamw_over(parameters).step for parameters in (plain, split))
    with WorkCounter() as counter:
        adamw_over(traced).step()
    inputs = torch.randn(SAMPLES, WIDTH, device=device)
    models = [wrapped_model(wrappers, {"tp": mesh}, device) for wrappers in ((), ("tp",))]
    works = [plain_step, split_step, *(passes(model, inputs) for model in models)]
    plain_s, split_s, pass_s, tp_pass_s = best_times_s(works, device, REPEATS)
    return {
        "op": max(0.0, (split_s - plain_s) / counter.ops),
        "layer": max(0.0, (tp_pass_s - pass_s) / len(calibration_styles())),
    }


def adamw_over(parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The template's AdamW (fused on GPUs) over `parameters`, torch's default settings."""
    return adamw([{"params": parameters}], betas=(0.9, 0.999), lr=1e-3)


def passes(model: nn.Module, inputs: torch.Tensor) -> Callable[[], None]:
    """`model`'s forward and backward on `inputs`, its gradients dropped after."""

    def run() -> None:
        loss_of(model(inputs), inputs).backward()
        model.zero_grad(set_to_none=True)

    return run


def replica_threads_s(
    device: torch.device, counts: tuple[int, ...] = REPLICA_COUNTS
) -> dict[str, float]:
    """By replicas (`counts`): a micro-step's seconds under dp's replicas run in threads of this
    process (`replicas.apply.DataParallel` on CPU) beyond the same step of the module
    itself over the whole batch."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(REPLICA_WIDTH, REPLICA_WIDTH), nn.ReLU()) for _ in "abcd"]
    model = nn.Sequential(*blocks).to(device)
    beyond = {}
    for replicas in counts:
        inputs = torch.randn(replicas * REPLICA_SAMPLES, REPLICA_WIDTH, device=device)
        wrapped = DataParallel(model, [device] * replicas, gather_outputs=True)
        steps = [training_step(module, inputs) for module in (model, wrapped)]
        plain, threaded = (typical_time_s(step, device, REPEATS) for step in steps)
        beyond[str(replicas)] = max(0.0, threaded - plain)
    return beyond
