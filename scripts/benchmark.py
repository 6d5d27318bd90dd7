"""Measure what the template costs over hand-written PyTorch, and strategies against each other,
on the same workload.

    python scripts/benchmark.py                         # every comparison
    python scripts/benchmark.py --only model_parallel   # one of them
    python scripts/benchmark.py --rounds 7 --steps 400

Each comparison runs two sides in alternating rounds in this process tree, so both see the same
machine state, and prints the median steady-state samples/s and step time of each and their
speed ratio (first / second). Warm-up steps are left out of both.

    single          the template's `parallel=single` / a plain PyTorch loop (1.0: no overhead)
    model_parallel  2 stages, GPipe over 4 micro-batches / the naive schedule; on CPU the stages
                    cannot overlap, so this shows what pipelining costs; on GPUs, what it gains
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.config import register_configs  # noqa: E402
from src.experiment import check_config, train  # noqa: E402

WARMUP_STEPS = 20
BATCH_SIZE = 256
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


def compose_config(*overrides: str) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def template_speed(steps: int, *overrides: str) -> float:
    """samples/s of the workload with these overrides through the template's own `train`."""
    cfg = compose_config(
        *WORKLOAD,
        *overrides,
        f"trainer.max_steps={steps}",
        f"trainer.timing_warmup_steps={WARMUP_STEPS}",
        "trainer.log_every=50",
        "trainer.eval_every=0",
    )
    with tempfile.TemporaryDirectory() as run_dir:
        return train(cfg, Path(run_dir), check_config(cfg))["samples_per_sec"]


def template_single(steps: int) -> float:
    return template_speed(steps, "parallel=single")


def model_parallel_pipelined(steps: int) -> float:
    return template_speed(steps, "parallel=model_parallel", "parallel.microbatches=4")


def model_parallel_naive(steps: int) -> float:
    return template_speed(steps, "parallel=model_parallel", "parallel.microbatches=1")


def plain_single(steps: int) -> float:
    """The same model, data, optimizer and batch in a loop written by hand."""
    cfg = compose_config(*WORKLOAD)
    data = instantiate(cfg.data, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay
    )
    inputs, targets = data.train.inputs, data.train.targets
    batch_size = cfg.trainer.batch_size
    generator = torch.Generator().manual_seed(cfg.seed)
    order, position = torch.randperm(len(targets), generator=generator), 0
    for step in range(steps):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        if position + batch_size > len(targets):
            order, position = torch.randperm(len(targets), generator=generator), 0
        batch = order[position : position + batch_size]
        position += batch_size
        loss = F.cross_entropy(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            loss.item()
    return (steps - WARMUP_STEPS) * batch_size / (time.perf_counter() - started)


Run = Callable[[int], float]
COMPARISONS: dict[str, tuple[tuple[str, Run], tuple[str, Run]]] = {
    "single": (("template", template_single), ("plain", plain_single)),
    "model_parallel": (
        ("pipelined M=4", model_parallel_pipelined),
        ("naive M=1", model_parallel_naive),
    ),
}


def compare(name: str, rounds: int, steps: int) -> tuple[float, float]:
    """Median samples/s of the comparison's first and second side."""
    (_, first), (_, second) = COMPARISONS[name]
    first_speeds, second_speeds = [], []
    for round_index in range(rounds):
        # Alternate which side goes first so that neither always follows the other.
        order = [(first, first_speeds), (second, second_speeds)]
        for run, speeds in order if round_index % 2 == 0 else reversed(order):
            speeds.append(run(steps))
    return statistics.median(first_speeds), statistics.median(second_speeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(COMPARISONS), action="append")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    register_configs()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds x {args.steps} steps ({WARMUP_STEPS} warm-up), "
        f"batch {BATCH_SIZE}"
    )
    sides = "".join(f"  {side:<16}{'samples/s':>11}{'ms/step':>9}" for side in ("first", "second"))
    print(f"{'comparison':<16}{sides}{'ratio':>8}")
    for name in args.only or COMPARISONS:
        speeds = compare(name, args.rounds, args.steps)
        cells = "".join(
            f"  {label:<16}{speed:>11,.0f}{1000 * BATCH_SIZE / speed:>9.2f}"
            for (label, _), speed in zip(COMPARISONS[name], speeds, strict=True)
        )
        print(f"{name:<16}{cells}{speeds[0] / speeds[1]:>8.3f}")


if __name__ == "__main__":
    main()
