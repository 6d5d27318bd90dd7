"""The template against itself with one setting changed, on one device: model_parallel's
schedules, the loader's workers, and compile, bf16, fp16 and the three kinds of activation
checkpointing on a small transformer."""

from __future__ import annotations

import statistics

import torch
from hydra.utils import instantiate
from torch.distributed._tools.mem_tracker import MemTracker

from benchmarks import workload
from benchmarks.workload import (
    WORKLOAD,
    compose_config,
    template_speed,
)
from src.components.blocks import prepare_blocks
from src.components.data import build_data
from src.config.trainer import Recomputation, TrainerConfig


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
TRANSFORMER_COMPARISONS = ("compile", "bf16", "fp16")


def transformer_speed(steps: int, *overrides: str) -> float:
    return template_speed(steps, "parallel=single", *overrides, workload=TRANSFORMER_WORKLOAD)


def transformer_memory_mb(recomputation: Recomputation) -> float:
    """Peak tensor memory, in MB, of one forward and backward pass of the transformer over a
    batch (parameters and gradients included) under `recomputation`: torch's MemTracker on CPU
    (its own count of the tensors' storage, not the process's RSS), the allocator's peak on
    CUDA."""
    cfg = compose_config(*TRANSFORMER_WORKLOAD)
    data = build_data(cfg.data, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    prepare_blocks(model, recomputation, False, TrainerConfig().checkpoint_ops)
    model.to(workload.DEVICE)
    inputs = data.train.inputs[:TRANSFORMER_BATCH_SIZE].to(workload.DEVICE)
    targets = data.train.targets[:TRANSFORMER_BATCH_SIZE].to(workload.DEVICE)
    task = instantiate(cfg.task)
    if workload.DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        task.sums(model(inputs), targets)[0].backward()
        return torch.cuda.max_memory_allocated() / 2**20
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        task.sums(model(inputs), targets)[0].backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / 2**20


def activation_checkpointing(rounds: int, steps: int) -> None:
    """The transformer under trainer.activation_checkpointing=none, selective and full: the
    median time per step over the rounds (each round runs the three, its first one turning
    round by round, so that none always follows another), against none's, and the peak tensor
    memory of a step."""
    modes = list(Recomputation)
    step_s: dict[Recomputation, list[float]] = {mode: [] for mode in modes}
    for round_index in range(rounds):
        turn = round_index % len(modes)
        for mode in modes[turn:] + modes[:turn]:
            speed = transformer_speed(steps, f"trainer.activation_checkpointing={mode}")
            step_s[mode].append(TRANSFORMER_BATCH_SIZE / speed)
    where = "CUDA" if workload.DEVICE == "cuda" else "CPU figures"
    counted = "CUDA allocator peak" if workload.DEVICE == "cuda" else "MemTracker tensor peak"
    print(f"{'checkpointing':<16}  {where}; time per step, and peak memory ({counted})")
    baseline = statistics.median(step_s[Recomputation.none])
    for mode in modes:
        seconds = statistics.median(step_s[mode])
        print(
            f"{'':<16}  {str(mode):<10}{seconds:>10.4f} s/step ({seconds / baseline:.2f}x "
            f"none's){transformer_memory_mb(mode):>9.2f} MB"
        )
