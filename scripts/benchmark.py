"""Measure what the template costs over hand-written PyTorch, and strategies against each other,
on the same workload.

    python scripts/benchmark.py                         # every comparison
    python scripts/benchmark.py --only model_parallel   # one of them
    python scripts/benchmark.py --rounds 7 --steps 400

Each comparison runs two sides in alternating rounds in this process tree, so both see the same
machine state, and prints the median steady-state samples/s and step time of each, and the
median over rounds of their speed ratio (first / second) with its range. Warm-up steps are left
out of both.

    single          the template's `parallel=single` / a plain PyTorch loop (1.0: no overhead),
                    both on the same device (a GPU when one is visible, see --device)
    resnet          the template's ResNet-18 (CIFAR stem, 64 wide) / torchvision's resnet18 given
                    the CIFAR stem by hand, SGD, on 3x32x32 images in batches of 32, the same
                    device (1.0: no overhead); on CPU try --steps 40
    overhead        the same on a tiny model (16 wide, batch 16), so that a step is almost all
                    host work: the difference in ms/step is the template's per-step overhead
    gpt2            the template's GPT / the same GPT in a nanoGPT-style loop (model and loss
                    compiled together, random batches on the device), with tokens/s, TFLOP/s
                    and MFU: gpt2_124m at 1024 tokens, bf16, compiled, batch 16 on a GPU (MFU
                    from the table of GPUs' peaks); a 2-block GPT, fp32, eager on a CPU
    model_parallel  2 stages, GPipe over 4 micro-batches / the naive schedule; on CPU the stages
                    cannot overlap, so this shows what pipelining costs; on GPUs, what it gains
    ddp             the template's `parallel=ddp`, 2 CPU processes started by its launcher / a
                    hand-written DDP loop in 2 processes (1.0: no overhead)
    fsdp            the template's `parallel=fsdp` / its `parallel=ddp`, 2 CPU processes each:
                    what sharding costs in time (an all-gather per block in forward and again
                    in backward); what it saves in memory is in each run's summary.json
    tp              the template's `parallel=tp` / its `parallel=ddp`, 2 processes each (the
                    MLP's Linears in 2 colwise/rowwise pairs, the head replicated): what an
                    all-reduce of the activations per pair, forward and backward, costs against
                    one of the gradients; on 2 GPUs where --device (cuda, or auto with a GPU
                    visible) has 2, else CPU figures (gloo): directions, not GPU ones
    pp              `parallel=pp`, 2 stages on 2 processes (GPUs as for tp) over 8 micro-batches,
                    under GPipe, 1F1B and Interleaved1F1B (2 stages per rank): ms/step and each
                    rank's measured idle fraction (its step's wall time outside its stages'
                    forward and backward chunks and loss) against the schedule's theoretical
                    bubble, (p - 1) / (m + p - 1), interleaved (p - 1) / (v m + p - 1); on CPU,
                    gloo's sends and the ranks' shared cores count as idle too
    checkpoint      how long a sharded fsdp checkpoint holds training up, saved synchronously
                    and with trainer.async_checkpoint=true: the training time async saves
    loader          `parallel=single` on augmented 3x16x16 images, made by 2 DataLoader workers
                    / in the training process (data.num_workers=2 / 0)
    plan            the planner's predicted peak memory per device (`python plan.py`) against
                    the peak MemTracker measures over two real training steps in each process
                    (src/launch/memory_check.py), for mlp and gpt under every strategy, resnet under
                    four, on CPU
    compile         `parallel=single` on a small transformer, trainer.compile=true / eager
                    (compiling happens in the warm-up steps, which are not timed)
    bf16, fp16      the same transformer under trainer.precision=bf16 or fp16 / fp32; on a CPU
                    these say how CPU autocast does, nothing of a GPU's tensor cores
    activation_ckpt
                    the same transformer with trainer.activation_checkpointing=true / without:
                    the time recomputation costs; then the peak tensor memory of a forward and
                    backward pass with and without it (torch's own count of tensor memory,
                    MemTracker, on CPU; the CUDA allocator's peak on a GPU)
    startup         wall time of a one-step `python train.py` (single, and ddp x2 on CPU) over
                    that of `python -c "import torch"`: what a sweep of short jobs pays per job;
                    and over its floor: `plain step` (import torch, one SGD step of a Linear),
                    `plain ddp x2` (the same step under DDP, 2 processes started by torchrun)
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.components.blocks import prepare_blocks  # noqa: E402
from src.components.data import Data, build_data  # noqa: E402
from src.config.schema import register_configs  # noqa: E402
from src.launch.job import train_worker  # noqa: E402
from src.launch.launcher import launch  # noqa: E402
from src.observe.performance import (  # noqa: E402
    device_peak_tflops,
    step_flops,
    throughput_figures,
)
from src.training.build import check_config  # noqa: E402
from src.training.trainer import train  # noqa: E402

WARMUP_STEPS = 20
BATCH_SIZE = 256
DEVICE = "cpu"  # set from --device in main()
WORKLOAD = (
    "model=mlp",
    "model.hidden=512",
    "model.depth=4",
    "data=synthetic",
    "data.input_dim=128",
    "data.num_samples=32768",
    f"trainer.batch_size={BATCH_SIZE}",
    "optimizer=adamw",
    "optimizer.schedule=constant",
    "optimizer.warmup_steps=0",
    "logger=none",
)
OVERHEAD_BATCH_SIZE = 16
# Tiny overrides on top of WORKLOAD: a step is then almost only the host's work.
OVERHEAD_WORKLOAD = (
    "model.hidden=16",
    "model.depth=1",
    "data.input_dim=16",
    "data.num_samples=4096",
    f"trainer.batch_size={OVERHEAD_BATCH_SIZE}",
)


def compose_config(*overrides: str) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def template_speed(steps: int, *overrides: str, workload: tuple[str, ...] = WORKLOAD) -> float:
    """samples/s of the workload with these overrides through the template's own `train`."""
    cfg = compose_config(
        *workload,
        f"trainer.accelerator={DEVICE}",
        *overrides,
        f"trainer.max_steps={steps}",
        f"trainer.timing_warmup_steps={WARMUP_STEPS}",
        "trainer.log_every=50",
        "trainer.eval_every=0",
    )
    with tempfile.TemporaryDirectory() as run_dir:
        return train(cfg, Path(run_dir), check_config(cfg, Path(run_dir)))["samples_per_sec"]


# SGD at a constant rate from the first step: the workloads compared with a plain SGD loop.
SGD_CONSTANT = ("optimizer=sgd", "optimizer.schedule=constant", "optimizer.warmup_steps=0")

# The `single` comparison's workload (issue 29): MLP 784-1024-1024-10, batch 256, SGD.
SINGLE_WORKLOAD = (
    *(setting for setting in WORKLOAD if not setting.startswith(("model.", "data.", "optimizer"))),
    "model.hidden=1024",
    "model.depth=2",
    "data.input_dim=784",
    "data.num_samples=32768",
    *SGD_CONSTANT,
)


def template_single(steps: int) -> float:
    return template_speed(steps, "parallel=single", workload=SINGLE_WORKLOAD)


def model_parallel_pipelined(steps: int) -> float:
    return template_speed(steps, "parallel=model_parallel", "parallel.microbatches=4")


def model_parallel_naive(steps: int) -> float:
    return template_speed(steps, "parallel=model_parallel", "parallel.microbatches=1")


def loader_speed(steps: int, num_workers: int) -> float:
    augmented = ("data.image_shape=[3,16,16]", "data.augment=true")
    return template_speed(steps, "parallel=single", *augmented, f"data.num_workers={num_workers}")


TRANSFORMER_BATCH_SIZE = 32
# WORKLOAD's optimizer on the default small transformer (64 wide, 2 blocks, 4 heads) and
# 32-token sequences of 64 symbols, 32 sequences a batch.
TRANSFORMER_WORKLOAD = (
    *(setting for setting in WORKLOAD if not setting.startswith(("model", "data", "trainer"))),
    "model=transformer",
    "data=synthetic_tokens",
    f"trainer.batch_size={TRANSFORMER_BATCH_SIZE}",
)
TRANSFORMER_COMPARISONS = ("compile", "bf16", "fp16", "activation_ckpt")


def transformer_speed(steps: int, *overrides: str) -> float:
    return template_speed(steps, "parallel=single", *overrides, workload=TRANSFORMER_WORKLOAD)


def transformer_memory_mb(activation_checkpointing: bool) -> float:
    """Peak tensor memory, in MB, of one forward and backward pass of the transformer over a
    batch (parameters and gradients included): torch's MemTracker on CPU (its own count of the
    tensors' storage, not the process's RSS), the allocator's peak on CUDA."""
    cfg = compose_config(*TRANSFORMER_WORKLOAD)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    prepare_blocks(model, activation_checkpointing, compile=False)
    model.to(DEVICE)
    inputs = data.train.inputs[:TRANSFORMER_BATCH_SIZE].to(DEVICE)
    targets = data.train.targets[:TRANSFORMER_BATCH_SIZE].to(DEVICE)
    task = instantiate(cfg.task)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        task.sums(model(inputs), targets)[0].backward()
        return torch.cuda.max_memory_allocated() / 2**20
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        task.sums(model(inputs), targets)[0].backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / 2**20


def print_activation_memory() -> None:
    kept, recomputed = transformer_memory_mb(False), transformer_memory_mb(True)
    counted = "CUDA allocator peak" if DEVICE == "cuda" else "CPU, MemTracker tensor peak"
    print(
        f"{'':<16}  peak tensor memory of a step ({counted}): {kept:.1f} MB without, "
        f"{recomputed:.1f} MB with activation checkpointing ({kept - recomputed:.1f} MB, "
        f"{(kept - recomputed) / kept:.0%} saved)"
    )


def template_overhead(steps: int) -> float:
    return template_speed(steps, "parallel=single", *OVERHEAD_WORKLOAD)


def plain_single(steps: int, *overrides: str) -> float:
    """The same model, data, optimizer and batch in a loop written by hand, on the template's
    device: data kept on a GPU (as the template keeps a small dataset), fused AdamW there, TF32
    matmuls (the template's default on CUDA)."""
    cfg = compose_config(*WORKLOAD, *overrides)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    model.to(DEVICE)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optimizer.lr,
        weight_decay=cfg.optimizer.weight_decay,
        fused=DEVICE == "cuda" or None,
    )
    return plain_loop(steps, model, optimizer, data, cfg.trainer.batch_size, cfg.seed)


def plain_loop(
    steps: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Data,
    batch_size: int,
    seed: int,
) -> float:
    """samples/s of a hand-written training loop over an in-memory set, on the device."""
    device = torch.device(DEVICE)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    inputs, targets = data.train.inputs.to(device), data.train.targets.to(device)
    generator = torch.Generator().manual_seed(seed)
    order, position = torch.randperm(len(targets), generator=generator).to(device), 0

    def loss_of_step() -> torch.Tensor:
        nonlocal order, position
        if position + batch_size > len(targets):
            order = torch.randperm(len(targets), generator=generator).to(device)
            position = 0
        batch = order[position : position + batch_size]
        position += batch_size
        return F.cross_entropy(model(inputs[batch]), targets[batch])

    return timed_steps(steps, batch_size, loss_of_step, optimizer)


def timed_steps(
    steps: int,
    batch_size: int,
    loss_of_step: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> float:
    """samples/s of a hand-written loop's steps after the warm-up: each backpropagates the loss
    `loss_of_step` returns and steps the optimizer; the loss is read every 50 steps."""
    for step in range(steps):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        loss = loss_of_step()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            loss.item()
    loss.item()  # wait for the queued steps
    return (steps - WARMUP_STEPS) * batch_size / (time.perf_counter() - started)


RESNET_BATCH_SIZE = 32
# ResNet-18 (64 wide, the CIFAR stem) with SGD on CIFAR-shaped images (3x32x32, 10 classes):
# synthetic ones, so that both sides read the same in-memory set without any files.
RESNET_WORKLOAD = (
    "model=resnet",
    "model.cifar_stem=true",
    "data=synthetic",
    "data.image_shape=[3,32,32]",
    "data.num_samples=2048",
    f"trainer.batch_size={RESNET_BATCH_SIZE}",
    *SGD_CONSTANT,
    "logger=none",
)


def template_resnet(steps: int) -> float:
    return template_speed(steps, "parallel=single", workload=RESNET_WORKLOAD)


def plain_resnet(steps: int) -> float:
    """torchvision's resnet18 given the CIFAR stem by hand (a 3x3 first convolution, no
    max-pool), as CIFAR training scripts do, with SGD, in the hand-written loop."""
    import torchvision

    cfg = compose_config(*RESNET_WORKLOAD)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = torchvision.models.resnet18(num_classes=data.num_classes)
    model.conv1 = torch.nn.Conv2d(3, 64, 3, padding=1, bias=False)
    model.maxpool = torch.nn.Identity()
    model.to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr, momentum=0.9)
    return plain_loop(steps, model, optimizer, data, RESNET_BATCH_SIZE, cfg.seed)


def plain_single_loader(steps: int) -> float:
    """SINGLE_WORKLOAD in a loop as a user writes it by hand: a DataLoader over a TensorDataset
    (shuffled, whole batches), SGD with the same learning rate and momentum."""
    cfg = compose_config(*SINGLE_WORKLOAD)
    device = torch.device(DEVICE)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    model.to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.momentum
    )
    dataset = TensorDataset(data.train.inputs, data.train.targets)
    loader = DataLoader(dataset, batch_size=cfg.trainer.batch_size, shuffle=True, drop_last=True)
    batches = (batch for _ in iter(int, 1) for batch in loader)  # endless, epoch after epoch
    for step in range(steps):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        inputs, targets = next(batches)
        inputs, targets = inputs.to(device), targets.to(device)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            loss.item()
    loss.item()  # wait for the queued steps
    return (steps - WARMUP_STEPS) * cfg.trainer.batch_size / (time.perf_counter() - started)


def plain_overhead(steps: int) -> float:
    return plain_single(steps, *OVERHEAD_WORKLOAD)


def gpt2_workload() -> tuple[str, ...]:
    """On a GPU, gpt2_124m on 1024-token sequences of GPT-2's vocabulary (padded to 50304),
    batch 16, bf16 and compiled; on a CPU, a GPT of 2 blocks 128 wide on 128-token sequences,
    batch 8, fp32 and eager. AdamW with nanoGPT's GPT-2 settings, at a constant rate."""
    if DEVICE == "cuda":
        shape = (
            "model=gpt2_124m",
            "data.vocab_size=50257",
            "data.seq_len=1024",
            "trainer.batch_size=16",
            "trainer.precision=bf16",
            "trainer.compile=true",
        )
    else:
        shape = (
            "model=gpt",
            "model.n_layer=2",
            "model.n_head=4",
            "model.n_embd=128",
            "data.vocab_size=512",
            "data.seq_len=128",
            "trainer.batch_size=8",
        )
    return (
        "data=synthetic_tokens",
        "task=language_model",
        "data.num_samples=1024",
        *shape,
        "optimizer=adamw",
        "optimizer.lr=6e-4",
        "optimizer.weight_decay=0.1",
        "optimizer.betas=[0.9,0.95]",
        "optimizer.schedule=constant",
        "optimizer.warmup_steps=0",
        "logger=none",
    )


def template_gpt2(steps: int) -> float:
    return template_speed(steps, "parallel=single", workload=gpt2_workload())


def plain_gpt2(steps: int) -> float:
    """The same GPT in a nanoGPT-style loop: the model and its loss compiled as one function
    (when the workload compiles), autocast, fused AdamW on a GPU with biases and norms
    undecayed, random batches of sequences held on the device, the loss read every 50 steps."""
    cfg = compose_config(*gpt2_workload())
    device = torch.device(DEVICE)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    model.to(device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [param for param in params if param.dim() >= 2]},
            {"params": [param for param in params if param.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.optimizer.lr,
        betas=tuple(cfg.optimizer.betas),
        weight_decay=cfg.optimizer.weight_decay,
        fused=device.type == "cuda" or None,
    )

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    step_loss = torch.compile(loss_of) if cfg.trainer.compile else loss_of
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.trainer.precision)
    inputs, targets = data.train.inputs.to(device), data.train.targets.to(device)
    batch_size = cfg.trainer.batch_size

    def loss_of_step() -> torch.Tensor:
        batch = torch.randint(len(targets), (batch_size,), device=device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            return step_loss(inputs[batch], targets[batch])

    return timed_steps(steps, batch_size, loss_of_step, optimizer)


def print_gpt2_figures(samples_per_sec: list[float]) -> None:
    """Tokens/s, TFLOP/s and MFU of the gpt2 comparison's two sides: the FLOPs of a step
    counted on the meta device, the peak from the table of GPUs (none on a CPU)."""
    cfg = compose_config(*gpt2_workload())
    data = build_data(cfg.data, cfg.seed)
    with torch.device("meta"):
        model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    batch_size = cfg.trainer.batch_size
    flops = step_flops(model, instantiate(cfg.task), data, batch_size)
    peak = device_peak_tflops(None, torch.device(DEVICE), cfg.trainer.precision, "high")
    for (label, _), speed in zip(COMPARISONS["gpt2"], samples_per_sec, strict=True):
        figures = throughput_figures(flops, 1000 * batch_size / speed, 1, peak)
        mfu = f"{figures['mfu']:.1%} MFU" if "mfu" in figures else "MFU n/a (no peak for a CPU)"
        print(
            f"{'':<16}  {label}: {speed * cfg.data.seq_len:,.0f} tokens/s, "
            f"{figures['tflops_per_sec']:.3g} TFLOP/s, {mfu}"
        )


DDP_PROCESSES = 2


def mesh_accelerator() -> str:
    """Where the tp and pp comparisons run: on GPUs with --device cuda where there are enough
    (ddp and fsdp compare with hand-written loops on gloo, so they stay on the CPU)."""
    enough_gpus = DEVICE == "cuda" and torch.cuda.device_count() >= DDP_PROCESSES
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


def launched_summary(steps: int, strategy: str, *overrides: str, accelerator: str = "cpu") -> dict:
    """summary.json of the workload on 2 processes (CPU or GPU) started by the template's
    launcher."""
    cfg = compose_config(
        *WORKLOAD,
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
        return launch(train_worker, (resolved, run_dir), processes, 1, cfg.parallel, no_logging)


def template_ddp(steps: int) -> float:
    return template_launched(steps, "ddp")


def template_fsdp(steps: int) -> float:
    return template_launched(steps, "fsdp")


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
    from src.parallel.pipeline_schedules import schedule_bubble

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


def plain_ddp_worker(rank: int, workload: dict, steps: int, port: int, result_path: str) -> None:
    """A hand-written DDP loop, as `torchrun --nproc_per_node=2` would run it (1 thread/rank)."""
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // DDP_PROCESSES))
    store = dist.TCPStore("127.0.0.1", port, DDP_PROCESSES, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=DDP_PROCESSES)
    cfg = OmegaConf.create(workload)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay
    )
    inputs, targets = data.train.inputs, data.train.targets
    local_batch = BATCH_SIZE // DDP_PROCESSES
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
        loss = F.cross_entropy(model(inputs[batch]), targets[batch])
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


def plain_ddp(steps: int) -> float:
    workload = OmegaConf.to_container(compose_config(*WORKLOAD), resolve=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as result_dir:
        result_path = str(Path(result_dir) / "samples_per_sec")
        torch.multiprocessing.spawn(
            plain_ddp_worker, args=(workload, steps, port, result_path), nprocs=DDP_PROCESSES
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


PLAN_MODELS = {
    "mlp": ("model=mlp", "trainer.batch_size=64"),
    "gpt": (
        "model=gpt",
        "data=synthetic_tokens",
        "task=language_model",
        "data.seq_len=64",
        "trainer.batch_size=16",
    ),
    "resnet": (
        "model=resnet",
        "model.width=8",
        "model.cifar_stem=true",
        "data.image_shape=[3,32,32]",
        "data.num_samples=256",
        "trainer.batch_size=16",
    ),
}
PLAN_STRATEGIES = {
    "single": ("parallel=single",),
    "single, checkpointing": ("parallel=single", "trainer.activation_checkpointing=true"),
    "single, bf16": ("parallel=single", "trainer.precision=bf16"),
    "dp 2": ("parallel=dp", "parallel.devices=2"),
    "dp_criterion 2": ("parallel=dp_criterion", "parallel.devices=2"),
    "model_parallel 2, M=2": ("parallel=model_parallel", "parallel.microbatches=2"),
    "ddp 2": ("parallel=ddp", "parallel.devices=2"),
    "fsdp 2": ("parallel=fsdp", "parallel.devices=2"),
    "hybrid 2x2, M=2": ("parallel=hybrid", "parallel.devices=4", "parallel.microbatches=2"),
    "model_parallel 2": ("parallel=model_parallel",),
}
# The strategies each model is planned under (resnet: those tests/test_plan.py holds it to).
PLAN_CASES = {
    "mlp": [label for label in PLAN_STRATEGIES if label != "model_parallel 2"],
    "gpt": [label for label in PLAN_STRATEGIES if label != "model_parallel 2"],
    "resnet": ["single", "ddp 2", "fsdp 2", "model_parallel 2"],
}


def plan_accuracy() -> None:
    """Predicted against measured peak tensor memory per process (MB), every model x strategy."""
    from src.launch.memory_check import measured_peaks_mb
    from src.planning.planner import MB, plan_all

    print(f"{'model':<6}{'strategy':<24}{'predicted MB':>13}{'measured MB':>13}{'ratio':>8}")
    for model, model_overrides in PLAN_MODELS.items():
        for label in PLAN_CASES[model]:
            cfg = compose_config(*model_overrides, *PLAN_STRATEGIES[label], "logger=none")
            (plan,) = plan_all(cfg, [cfg.parallel])
            measured = measured_peaks_mb(cfg)["training"]["Total"]
            predicted = plan.peak / MB
            ratio = predicted / measured
            print(f"{model:<6}{label:<24}{predicted:>13.2f}{measured:>13.2f}{ratio:>8.3f}")


ONE_STEP = ("trainer.max_steps=1", "trainer.eval_every=0", "logger=none")
# The floors: a plain PyTorch process that takes one SGD step, and the same step under DDP in
# torchrun's processes (a torch.optim optimizer imports torch._dynamo, its constructor and step
# do, which takes about as long again as `import torch`).
PLAIN_STEP = """
import torch
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(8, 4)).sum().backward()
optimizer.step()
"""
PLAIN_DDP_STEP = """
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(8, 4)).sum().backward()
optimizer.step()
dist.destroy_process_group()
"""


def startup_commands(script_dir: Path) -> dict[str, list[str]]:
    """The start-up comparison's commands; torchrun's script is written to `script_dir`."""
    plain_ddp_script = script_dir / "plain_ddp_step.py"
    plain_ddp_script.write_text(PLAIN_DDP_STEP)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return {
        "import torch": [sys.executable, "-c", "import torch"],
        "plain step": [sys.executable, "-c", PLAIN_STEP],
        "single": [sys.executable, "train.py", *ONE_STEP],
        "plain ddp x2": [*torchrun, f"--nproc_per_node={DDP_PROCESSES}", str(plain_ddp_script)],
        "ddp x2": [
            sys.executable,
            "train.py",
            *ONE_STEP,
            "parallel=ddp",
            f"parallel.devices={DDP_PROCESSES}",
            "trainer.accelerator=cpu",
        ],
    }


def wall_time_s(command: list[str]) -> float:
    """Seconds from start to exit of `command` (in a run directory of its own)."""
    with tempfile.TemporaryDirectory() as run_dir:
        started = time.perf_counter()
        ended = subprocess.run(
            [*command, f"hydra.run.dir={run_dir}"] if "train.py" in command else command,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if ended.returncode != 0:
            sys.exit(f"{shlex.join(command)} failed ({ended.returncode}):\n{ended.stderr[-3000:]}")
        return time.perf_counter() - started


def startup(rounds: int) -> None:
    """Median wall time of each start-up command over rounds (their order rotating from round
    to round), its ratio to `import torch`, and each train.py run's ratio to its plain floor."""
    with tempfile.TemporaryDirectory() as script_dir:
        commands = startup_commands(Path(script_dir))
        times: dict[str, list[float]] = {name: [] for name in commands}
        names = list(commands)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(wall_time_s(commands[name]))
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    base = medians["import torch"]
    cells = " | ".join(
        f"{name} {seconds:.2f} s ({seconds / base:.2f}x)" for name, seconds in medians.items()
    )
    print(f"{'startup':<16}  {cells}")
    for run, floor in (("single", "plain step"), ("ddp x2", "plain ddp x2")):
        print(f"{'':<16}  {run} / {floor}: {medians[run] / medians[floor]:.2f}x")


Run = Callable[[int], float]
COMPARISONS: dict[str, tuple[tuple[str, Run], tuple[str, Run]]] = {
    "single": (("template", template_single), ("plain", plain_single_loader)),
    "overhead": (("template", template_overhead), ("plain", plain_overhead)),
    "gpt2": (("template", template_gpt2), ("nanoGPT-style", plain_gpt2)),
    "resnet": (("template", template_resnet), ("torchvision", plain_resnet)),
    "model_parallel": (
        ("pipelined M=4", model_parallel_pipelined),
        ("naive M=1", model_parallel_naive),
    ),
    "ddp": (("template", template_ddp), ("plain DDP", plain_ddp)),
    "fsdp": (("fsdp", template_fsdp), ("ddp", template_ddp)),
    "tp": (("tp 2", template_tp), ("ddp 2", template_ddp_beside_tp)),
    "loader": (
        ("2 workers", lambda steps: loader_speed(steps, 2)),
        ("0 workers", lambda steps: loader_speed(steps, 0)),
    ),
    "compile": (
        ("compiled", lambda steps: transformer_speed(steps, "trainer.compile=true")),
        ("eager", transformer_speed),
    ),
    "bf16": (
        ("bf16", lambda steps: transformer_speed(steps, "trainer.precision=bf16")),
        ("fp32", transformer_speed),
    ),
    "fp16": (
        ("fp16", lambda steps: transformer_speed(steps, "trainer.precision=fp16")),
        ("fp32", transformer_speed),
    ),
    "activation_ckpt": (
        (
            "checkpointed",
            lambda steps: transformer_speed(steps, "trainer.activation_checkpointing=true"),
        ),
        ("kept", transformer_speed),
    ),
}


def compare(name: str, rounds: int, steps: int) -> tuple[float, float, list[float]]:
    """Median samples/s of the comparison's first and second side, and each round's ratio."""
    (_, first), (_, second) = COMPARISONS[name]
    first_speeds, second_speeds = [], []
    for round_index in range(rounds):
        # Alternate which side goes first so that neither always follows the other.
        order = [(first, first_speeds), (second, second_speeds)]
        for run, speeds in order if round_index % 2 == 0 else reversed(order):
            speeds.append(run(steps))
    ratios = [a / b for a, b in zip(first_speeds, second_speeds, strict=True)]
    return statistics.median(first_speeds), statistics.median(second_speeds), ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only",
        choices=[*sorted(COMPARISONS), "checkpoint", "plan", "pp", "startup"],
        action="append",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where single, overhead and model_parallel run (auto: a GPU when one is visible); "
        "ddp and fsdp always run 2 CPU processes, tp and pp 2 GPUs where the device has them",
    )
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be above the {WARMUP_STEPS} warm-up steps, got {args.steps}")
    global DEVICE
    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    DEVICE = auto_device if args.device == "auto" else args.device
    register_configs()
    gpu = f", {torch.cuda.get_device_name()}" if DEVICE == "cuda" else ""
    print(
        f"torch {torch.__version__}, device {DEVICE}{gpu}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds x {args.steps} steps ({WARMUP_STEPS} warm-up), "
        f"batch {BATCH_SIZE} ({OVERHEAD_BATCH_SIZE} for overhead, {TRANSFORMER_BATCH_SIZE} for the "
        "transformer's)"
    )
    sides = "".join(f"  {side:<16}{'samples/s':>11}{'ms/step':>9}" for side in ("first", "second"))
    print(f"{'comparison':<16}{sides}{'ratio':>8}  (rounds' ratios: min-max)")
    for name in args.only or [*COMPARISONS, "checkpoint", "pp", "startup"]:
        if name == "checkpoint":
            checkpoint_blocking(args.rounds, args.steps)
            continue
        if name == "pp":
            pipeline_idle(args.rounds, args.steps)
            continue
        if name == "plan":
            plan_accuracy()
            continue
        if name == "startup":
            startup(args.rounds)
            continue
        *speeds, ratios = compare(name, args.rounds, args.steps)
        batch = OVERHEAD_BATCH_SIZE if name == "overhead" else BATCH_SIZE
        if name in TRANSFORMER_COMPARISONS:
            batch = TRANSFORMER_BATCH_SIZE
        if name == "resnet":
            batch = RESNET_BATCH_SIZE
        if name == "gpt2":
            batch = compose_config(*gpt2_workload()).trainer.batch_size
        step_ms = [1000 * batch / speed for speed in speeds]
        cells = "".join(
            f"  {label:<16}{speed:>11,.0f}{ms:>9.3f}"
            for (label, _), speed, ms in zip(COMPARISONS[name], speeds, step_ms, strict=True)
        )
        # The median of the rounds' ratios: each round's two sides ran back to back, so a
        # machine that speeds up or slows down between rounds moves both.
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(f"{name:<16}{cells}{statistics.median(ratios):>8.3f}  ({spread})")
        if name == "overhead":
            print(f"{'':<16}  the template's host work: {step_ms[0] - step_ms[1]:+.3f} ms/step")
        if name == "tp":
            print(f"{'':<16}  {where_launched()}")
        if name in ("bf16", "fp16") and DEVICE == "cpu":
            print(f"{'':<16}  CPU figures (autocast on the CPU): they say nothing of a GPU")
        if name == "activation_ckpt":
            print_activation_memory()
        if name == "gpt2":
            print_gpt2_figures(speeds)


if __name__ == "__main__":
    main()
