"""Comparisons of 2 processes started by the template's launcher: ddp (against a hand-written
DDP loop), fsdp (under AdamW and Muon too), tp, pp's schedules, and how long checkpoints hold
training up."""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from benchmarks import workload
from benchmarks.workload import (
    WARMUP_STEPS,
    WORKLOAD,
    compose_config,
    cross_entropy,
)
from src.components.data import build_data
from src.components.model_contract import build_model
from src.launch.job import train_worker
from src.launch.launcher import launch
from src.training.build import check_config

DDP_PROCESSES = 2


def mesh_accelerator() -> str:
    """Where the tp and pp comparisons run: on GPUs with --device cuda where there are enough
    (ddp and fsdp compare with hand-written loops on gloo, so they stay on the CPU)."""
    enough_gpus = workload.DEVICE == "cuda" and torch.cuda.device_count() >= DDP_PROCESSES
    return "cuda" if enough_gpus else "cpu"


def where_launched() -> str:
    """What the tp and pp figures are figures of."""
    if mesh_accelerator() == "cuda":
        return f"{DDP_PROCESSES} GPUs ({torch.cuda.get_device_name()}, NCCL)"
    return f"CPU figures ({DDP_PROCESSES} gloo processes): directions, not GPU ones"


def template_launched(steps: int, strategy: str, accelerator: str = "cpu") -> float:
    """samples/s of a multi-process strategy with 2 processes, started by the template's
    launcher."""
    return launched_summary(steps, strategy, accelerator=accelerator)["samples_per_sec"]


def launched_summary(
    steps: int,
    strategy: str,
    *overrides: str,
    accelerator: str = "cpu",
    workload: tuple[str, ...] = WORKLOAD,
) -> dict:
    """summary.json of the workload on 2 processes (CPU or GPU) started by the template's
    launcher."""
    cfg = compose_config(
        *workload,
        f"parallel={strategy}",
        f"parallel.devices={DDP_PROCESSES}",
        f"trainer.accelerator={accelerator}",
        f"trainer.max_steps={steps}",
        f"trainer.timing_warmup_steps={WARMUP_STEPS}",
        "trainer.log_every=50",
        "trainer.eval_every=0",
        *overrides,
    )
    resolved = OmegaConf.to_container(cfg, resolve=True)
    with tempfile.TemporaryDirectory() as run_dir:
        processes = check_config(cfg, Path(run_dir)).processes_per_node
        no_logging = {"version": 1, "disable_existing_loggers": False}
        args = (resolved, run_dir, None)  # a new run: no checkpoint to resume
        return launch(train_worker, args, processes, 1, cfg.parallel, no_logging)


def template_ddp(steps: int) -> float:
    return template_launched(steps, "ddp")


def template_fsdp(steps: int) -> float:
    return template_launched(steps, "fsdp")


def template_fsdp_under(optimizer: str) -> Callable[[int], float]:
    """`template_fsdp` with `optimizer=<optimizer>` (the workload's is adamw)."""
    setting = f"optimizer={optimizer}"
    return lambda steps: launched_summary(steps, "fsdp", setting)["samples_per_sec"]


def template_tp(steps: int) -> float:
    return template_launched(steps, "tp", mesh_accelerator())


def template_ddp_beside_tp(steps: int) -> float:
    return template_launched(steps, "ddp", mesh_accelerator())


PIPELINE_MICROBATCHES = 8
# The schedules `--only pp` compares, with their stages per rank.
PIPELINE_SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}
# The final evaluation in one batch of 8 equal micro-batches (3280 of 32800 samples): a pp
# stage's buffers take the shapes of its first micro-batches, and a last, smaller eval batch
# (3276 samples in batches of 512) failed.
PIPELINE_EVAL = ("data.num_samples=32800", "trainer.eval_batch_size=3280")


def pipeline_idle(rounds: int, steps: int) -> None:
    """Each schedule on 2 processes (rounds alternate their order): the median step time
    and each rank's median idle fraction over the rounds, beside the theoretical bubble."""
    from src.parallel.pp.costs import schedule_bubble

    runs: dict[str, list[dict]] = {schedule: [] for schedule in PIPELINE_SCHEDULES}
    for round_index in range(rounds):
        order = list(PIPELINE_SCHEDULES.items())
        for schedule, stages_per_rank in order if round_index % 2 == 0 else reversed(order):
            summary = launched_summary(
                steps,
                "pp",
                f"parallel.schedule={schedule}",
                f"parallel.stages_per_rank={stages_per_rank}",
                f"parallel.microbatches={PIPELINE_MICROBATCHES}",
                *PIPELINE_EVAL,
                accelerator=mesh_accelerator(),
            )
            runs[schedule].append(summary)
    print(
        f"{'pp':<16}  2 stages on {DDP_PROCESSES} processes, M={PIPELINE_MICROBATCHES}: "
        f"{where_launched()}"
    )
    for schedule, stages_per_rank in PIPELINE_SCHEDULES.items():
        step_ms = statistics.median(summary["step_time_ms"] for summary in runs[schedule])
        ranks = [summary["pipeline"]["idle_fraction_per_rank"] for summary in runs[schedule]]
        per_rank = zip(*ranks, strict=True)
        idle = ", ".join(f"{100 * statistics.median(shares):.0f}%" for shares in per_rank)
        bubble = schedule_bubble(DDP_PROCESSES, stages_per_rank, PIPELINE_MICROBATCHES)
        print(
            f"{'':<16}  {schedule:<16} v={stages_per_rank} {step_ms:>9.2f} ms/step  idle per rank "
            f"(measured) {idle}  bubble (theory) {100 * bubble:.1f}%"
        )


def plain_optimizer(settings: DictConfig, parameters: Iterable) -> torch.optim.Optimizer:
    """The workload's optimizer as a hand-written loop builds it: SGD with momentum or AdamW."""
    if settings.name == "sgd":
        return torch.optim.SGD(parameters, lr=settings.lr, momentum=settings.momentum)
    return torch.optim.AdamW(parameters, lr=settings.lr, weight_decay=settings.weight_decay)


def plain_ddp_worker(rank: int, workload: dict, steps: int, port: int, result_path: str) -> None:
    """A hand-written DDP loop, as `torchrun --nproc_per_node=2` would run it (1 thread/rank)."""
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // DDP_PROCESSES))
    store = dist.TCPStore("127.0.0.1", port, DDP_PROCESSES, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=DDP_PROCESSES)
    cfg = OmegaConf.create(workload)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    model = DistributedDataParallel(model)
    optimizer = plain_optimizer(cfg.optimizer, model.parameters())
    inputs, targets = data.train.inputs, data.train.targets
    local_batch = cfg.trainer.batch_size // DDP_PROCESSES
    generator = torch.Generator().manual_seed(cfg.seed)
    order, position = torch.randperm(len(targets), generator=generator), 0
    for step in range(steps):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        if position + cfg.trainer.batch_size > len(targets):
            order, position = torch.randperm(len(targets), generator=generator), 0
        start = position + rank * local_batch
        batch = order[start : start + local_batch]
        position += cfg.trainer.batch_size
        loss = cross_entropy(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            loss.item()
    seconds = time.perf_counter() - started
    if rank == 0:
        speed = (steps - WARMUP_STEPS) * cfg.trainer.batch_size / seconds
        Path(result_path).write_text(str(speed))
    dist.destroy_process_group()


def plain_ddp(steps: int, workload: tuple[str, ...] = WORKLOAD) -> float:
    """samples/s of the workload in a hand-written DDP loop, 2 processes."""
    resolved = OmegaConf.to_container(compose_config(*workload), resolve=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as result_dir:
        result_path = str(Path(result_dir) / "samples_per_sec")
        torch.multiprocessing.spawn(
            plain_ddp_worker, args=(resolved, steps, port, result_path), nprocs=DDP_PROCESSES
        )
        return float(Path(result_path).read_text())


CHECKPOINT_EVERY = 25


def checkpoint_blocking(rounds: int, steps: int) -> None:
    """How long a sharded fsdp checkpoint (2 CPU processes) holds training up, written in the
    foreground or in the background (`trainer.async_checkpoint`): the median over rounds of each
    run's median per checkpoint (`checkpoint_blocked_s`)."""
    blocked: dict[bool, list[float]] = {False: [], True: []}
    for round_index in range(rounds):
        for use_async in (False, True) if round_index % 2 == 0 else (True, False):
            summary = launched_summary(
                steps,
                "fsdp",
                "trainer.checkpoint_format=sharded",
                f"trainer.checkpoint_every={CHECKPOINT_EVERY}",
                f"trainer.async_checkpoint={str(use_async).lower()}",
            )
            blocked[use_async].append(1000 * summary["checkpoint_blocked_s"])
    sync_ms, async_ms = (statistics.median(blocked[use_async]) for use_async in (False, True))
    print(
        f"{'checkpoint':<16}  sharded fsdp, every {CHECKPOINT_EVERY} steps: training held up "
        f"{sync_ms:.1f} ms per checkpoint, {async_ms:.1f} ms with trainer.async_checkpoint "
        f"({sync_ms - async_ms:+.1f} ms saved per checkpoint)"
    )
