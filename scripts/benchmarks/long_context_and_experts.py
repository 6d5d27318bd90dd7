"""Context parallel and expert parallel against `ddp` on the same global batch (2 processes,
started by the template's launcher), and the longest sequence the planner fits at a fixed memory
per device under cp 1, 2 and 4."""

from __future__ import annotations

from benchmarks.launched import launched_summary, mesh_accelerator
from benchmarks.workload import WORKLOAD, compose_config

# WORKLOAD's optimizer and logger on the tiny GPT (2 blocks, 64 wide, 2 heads) over 512-token
# sequences, 8 a batch: long enough that attention is a real part of the step, small enough for
# a step of a few tens of milliseconds on a CPU.
CP_BATCH_SIZE = 8
CP_WORKLOAD = (
    *(setting for setting in WORKLOAD if not setting.startswith(("model", "data", "trainer"))),
    "model=gpt",
    "data.seq_len=512",
    "data.num_samples=512",
    f"trainer.batch_size={CP_BATCH_SIZE}",
)
# The same optimizer on model=moe at its defaults (4 experts, top 2, 2 blocks 64 wide) over
# 128-token sequences, 16 a batch.
EP_BATCH_SIZE = 16
EP_WORKLOAD = (
    *(setting for setting in WORKLOAD if not setting.startswith(("model", "data", "trainer"))),
    "model=moe",
    "data.seq_len=128",
    "data.num_samples=1024",
    f"trainer.batch_size={EP_BATCH_SIZE}",
)


def launched_speed(steps: int, strategy: str, workload: tuple[str, ...]) -> float:
    """samples/s of the workload under a strategy on 2 processes (GPUs as for tp)."""
    summary = launched_summary(steps, strategy, accelerator=mesh_accelerator(), workload=workload)
    return summary["samples_per_sec"]


def template_cp(steps: int) -> float:
    return launched_speed(steps, "cp", CP_WORKLOAD)


def template_ddp_beside_cp(steps: int) -> float:
    return launched_speed(steps, "ddp", CP_WORKLOAD)


def template_ep(steps: int) -> float:
    return launched_speed(steps, "ep", EP_WORKLOAD)


def template_ddp_beside_ep(steps: int) -> float:
    return launched_speed(steps, "ddp", EP_WORKLOAD)


CP_DEGREES = (1, 2, 4)
CP_DEVICE_MEMORY_MB = 64
SHORTEST_SEQUENCE = 256


def fits(cp: int, seq_len: int) -> bool:
    """Whether the planner's predicted peak per device (training's or evaluation's, the higher)
    of CP_WORKLOAD at this sequence length under cp ranks fits CP_DEVICE_MEMORY_MB."""
    from src.planning.planner import plan_all

    cfg = compose_config(
        *CP_WORKLOAD,
        "parallel=cp",
        f"parallel.devices={cp}",
        f"data.seq_len={seq_len}",
        f"plan.device_memory_gb={CP_DEVICE_MEMORY_MB / 1024}",
    )
    (plan,) = plan_all(cfg, [cfg.parallel])
    return plan.fits


def longest_sequences() -> None:
    """For each cp degree, the longest power-of-two sequence that fits: doubling from the
    previous degree's longest (more cp ranks never fit a shorter one), so that each degree
    plans a few lengths."""
    longest = SHORTEST_SEQUENCE // 2
    lengths = []
    for cp in CP_DEGREES:
        while fits(cp, 2 * longest):
            longest *= 2
        lengths.append(f"cp {cp} {longest if longest >= SHORTEST_SEQUENCE else 'none'}")
    print(
        f"{'':<16}  longest sequence that fits {CP_DEVICE_MEMORY_MB} MB per device (the "
        f"planner's predicted peak, batch {CP_BATCH_SIZE}): {', '.join(lengths)}"
    )
