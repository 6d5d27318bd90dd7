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
    hf, hf_ddp      a model the template did not write: transformers' Llama (2 layers, 128
                    wide, 128-token sequences of 256 ids, batch 32, SGD), the template's
                    `parallel=single` / a hand-written loop on one device, and its `parallel=ddp`
                    / a hand-written DDP loop, 2 CPU processes each (1.0: no overhead)
    fsdp            the template's `parallel=fsdp` / its `parallel=ddp`, 2 CPU processes each:
                    what sharding costs in time (an all-gather per block in forward and again
                    in backward); what it saves in memory is in each run's summary.json
    muon            the template's `parallel=fsdp` under optimizer=muon / under optimizer=adamw,
                    2 CPU processes each: what Muon's step costs beside AdamW's where each
                    rank gathers every block matrix's update (one all-gather per matrix) and
                    orthogonalises it whole (5 Newton-Schulz iterations in bf16); CPU figures
    tp              the template's `parallel=tp` / its `parallel=ddp`, 2 processes each (the
                    MLP's Linears in 2 colwise/rowwise pairs, the head replicated): what an
                    all-reduce of the activations per pair, forward and backward, costs against
                    one of the gradients; on 2 GPUs where --device (cuda, or auto with a GPU
                    visible) has 2, else CPU figures (gloo): directions, not GPU ones
    cp              `parallel=cp` (cp 2) / `parallel=ddp`, 2 processes each (GPUs as for tp), on
                    the same global batch: a 2-block GPT, 64 wide, 8 sequences of 512 tokens;
                    each cp rank runs half of every sequence, each ddp rank half the sequences;
                    and the longest sequence (a power of two) the planner fits in 64 MB per
                    device under cp 1, 2 and 4 (its predicted peak: fake tensors, no run)
    ep              `parallel=ep` (ep 2) / `parallel=ddp`, 2 processes each (GPUs as for tp), on
                    the same global batch: model=moe (4 experts, top 2), 16 sequences of 128
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
    checkpointing   the same transformer under trainer.activation_checkpointing=none,
                    selective and full (three sides, not two): seconds per step of each (the
                    median over the rounds) against none's, the time recomputation costs; and
                    the peak tensor memory of a forward and backward pass under each (torch's
                    own count of tensor memory, MemTracker, on CPU; the CUDA allocator's peak on
                    a GPU)
    sample          sample.py's decoding (the GPT's key/value cache) / transformers' `generate`
                    with its cache, on the same weights (exported in the HF format) and device:
                    new tokens/s (the samples/s column; ms/step: ms per token), one sequence,
                    --steps tokens after a 16-token prompt; gpt2_124m's shape on a GPU, 4 blocks
                    256 wide on a CPU (there try --steps 100)
    progress        the default experiment (`python train.py`'s, logger=none) with progress on
                    every long phase (trainer.progress_every_s=2) / without (null): wall time,
                    evaluation and checkpoints included; and the reporter's own work per
                    training step (one clock read per evaluation batch) against the step time
    tokenize        `data=text`'s first start on about 50 MB of generated text (jsonl), GPT-2's
                    BPE (a .tiktoken file; offline, a stand-in of its size trained by
                    `tokenizers`), 2 tokenizing processes / tiktoken's `encode_ordinary_batch`
                    on 2 threads reading the same files, both on the same 2 cores: MB/s,
                    tokens/s and CPU time of each, their ratios by wall and by CPU time, and
                    the second start (the cache read)
    startup         wall time of a one-step `python train.py` (single, and ddp x2 on CPU) over
                    that of `python -c "import torch"`: what a sweep of short jobs pays per job;
                    and over its floor: `plain step` (import torch, one SGD step of a Linear),
                    `plain ddp x2` (the same step under DDP, 2 processes started by torchrun)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for src/

from benchmarks import workload  # noqa: E402
from benchmarks.against_plain import (  # noqa: E402
    RESNET_BATCH_SIZE,
    gpt2_workload,
    plain_gpt2,
    plain_overhead,
    plain_resnet,
    plain_single_loader,
    template_gpt2,
    template_overhead,
    template_resnet,
    template_single,
)
from benchmarks.any_model import (  # noqa: E402
    HF_BATCH_SIZE,
    plain_hf,
    plain_hf_ddp,
    template_hf,
    template_hf_ddp,
)
from benchmarks.launched import (  # noqa: E402
    DDP_PROCESSES,
    checkpoint_blocking,
    pipeline_idle,
    plain_ddp,
    template_ddp,
    template_ddp_beside_tp,
    template_fsdp,
    template_fsdp_under,
    template_tp,
    where_launched,
)
from benchmarks.long_context_and_experts import (  # noqa: E402
    CP_BATCH_SIZE,
    EP_BATCH_SIZE,
    longest_sequences,
    template_cp,
    template_ddp_beside_cp,
    template_ddp_beside_ep,
    template_ep,
)
from benchmarks.plan_accuracy import plan_accuracy  # noqa: E402
from benchmarks.progress_cost import progress_cost  # noqa: E402
from benchmarks.sampling import SAMPLE_BATCH, template_sample, transformers_sample  # noqa: E402
from benchmarks.startup import startup  # noqa: E402
from benchmarks.template_options import (  # noqa: E402
    TRANSFORMER_BATCH_SIZE,
    TRANSFORMER_COMPARISONS,
    activation_checkpointing,
    loader_speed,
    model_parallel_naive,
    model_parallel_pipelined,
    transformer_speed,
)
from benchmarks.tokenize import tokenize_speed  # noqa: E402
from benchmarks.workload import (  # noqa: E402
    BATCH_SIZE,
    OVERHEAD_BATCH_SIZE,
    WARMUP_STEPS,
    compose_config,
)

from src.components.data import build_data  # noqa: E402
from src.config.schema import register_configs  # noqa: E402
from src.observe.performance import (  # noqa: E402
    device_peak_tflops,
    step_flops,
    throughput_figures,
)


def print_gpt2_figures(samples_per_sec: list[float]) -> None:
    """Tokens/s, TFLOP/s and MFU of the gpt2 comparison's two sides: the FLOPs of a step
    counted on the meta device, the peak from the table of GPUs (none on a CPU)."""
    cfg = compose_config(*gpt2_workload())
    data = build_data(cfg.data, cfg.seed)
    with torch.device("meta"):
        model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    batch_size = cfg.trainer.batch_size
    flops = step_flops(model, instantiate(cfg.task), data, batch_size)
    peak = device_peak_tflops(None, torch.device(workload.DEVICE), cfg.trainer.precision, "high")
    for (label, _), speed in zip(COMPARISONS["gpt2"], samples_per_sec, strict=True):
        figures = throughput_figures(flops, 1000 * batch_size / speed, 1, peak)
        mfu = f"{figures['mfu']:.1%} MFU" if "mfu" in figures else "MFU n/a (no peak for a CPU)"
        print(
            f"{'':<16}  {label}: {speed * cfg.data.seq_len:,.0f} tokens/s, "
            f"{figures['tflops_per_sec']:.3g} TFLOP/s, {mfu}"
        )


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
    "hf": (("template", template_hf), ("plain", plain_hf)),
    "hf_ddp": (("template", template_hf_ddp), ("plain DDP", plain_hf_ddp)),
    "fsdp": (("fsdp", template_fsdp), ("ddp", template_ddp)),
    "muon": (
        ("fsdp muon", template_fsdp_under("muon")),
        ("fsdp adamw", template_fsdp_under("adamw")),
    ),
    "tp": (("tp 2", template_tp), ("ddp 2", template_ddp_beside_tp)),
    "cp": (("cp 2", template_cp), ("ddp 2", template_ddp_beside_cp)),
    "ep": (("ep 2", template_ep), ("ddp 2", template_ddp_beside_ep)),
    "sample": (("template", template_sample), ("transformers", transformers_sample)),
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
}


def batch_size(name: str) -> int:
    """Samples per step of a comparison's workload."""
    if name == "gpt2":
        return compose_config(*gpt2_workload()).trainer.batch_size
    own = {"overhead": OVERHEAD_BATCH_SIZE, "resnet": RESNET_BATCH_SIZE}
    own |= {"cp": CP_BATCH_SIZE, "ep": EP_BATCH_SIZE, "hf": HF_BATCH_SIZE, "hf_ddp": HF_BATCH_SIZE}
    own |= {"sample": SAMPLE_BATCH}
    own |= dict.fromkeys(TRANSFORMER_COMPARISONS, TRANSFORMER_BATCH_SIZE)
    return own.get(name, BATCH_SIZE)


def batches(names: list[str]) -> str:
    """The header's batch sizes of the comparisons among `names`: `BATCH_SIZE` plainly, the
    others by the comparisons that run them ("batch 256 (16 for overhead, 8 for cp)")."""
    by_size: dict[int, list[str]] = {}
    for name in names:
        if name in COMPARISONS:
            by_size.setdefault(batch_size(name), []).append(name)
    others = ", ".join(
        f"{size} for {'/'.join(group)}" for size, group in by_size.items() if size != BATCH_SIZE
    )
    if BATCH_SIZE not in by_size:
        return f"batch {others}" if others else ""
    return f"batch {BATCH_SIZE}" + (f" ({others})" if others else "")


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        choices=[
            *sorted(COMPARISONS),
            *("checkpoint", "checkpointing", "plan", "pp", "progress", "startup", "tokenize"),
        ],
        action="append",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where single, overhead and model_parallel run (auto: a GPU when one is visible); "
        "ddp and fsdp always run 2 CPU processes, tp, pp, cp and ep 2 GPUs where the device has "
        "them",
    )
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be above the {WARMUP_STEPS} warm-up steps, got {args.steps}")
    auto_device = "cuda" if torch.cuda.is_available() else "cpu"
    workload.DEVICE = auto_device if args.device == "auto" else args.device
    register_configs()
    gpu = f", {torch.cuda.get_device_name()}" if workload.DEVICE == "cuda" else ""
    others = ("checkpoint", "checkpointing", "pp", "progress", "startup", "tokenize")
    names = args.only or [*COMPARISONS, *others]
    header = (
        f"torch {torch.__version__}, device {workload.DEVICE}{gpu}, "
        f"{torch.get_num_threads()} threads, "
        f"{args.rounds} rounds x {args.steps} steps ({WARMUP_STEPS} warm-up)"
    )
    print(", ".join(part for part in (header, batches(names)) if part))
    sides = "".join(f"  {side:<16}{'samples/s':>11}{'ms/step':>9}" for side in ("first", "second"))
    print(f"{'comparison':<16}{sides}{'ratio':>8}  (rounds' ratios: min-max)")
    for name in names:
        if name == "checkpoint":
            checkpoint_blocking(args.rounds, args.steps)
            continue
        if name == "checkpointing":
            activation_checkpointing(args.rounds, args.steps)
            continue
        if name == "pp":
            pipeline_idle(args.rounds, args.steps)
            continue
        if name == "plan":
            plan_accuracy()
            continue
        if name == "progress":
            progress_cost(args.rounds, args.steps)
            continue
        if name == "startup":
            startup(args.rounds)
            continue
        if name == "tokenize":
            tokenize_speed(args.rounds)
            continue
        *speeds, ratios = compare(name, args.rounds, args.steps)
        step_ms = [1000 * batch_size(name) / speed for speed in speeds]
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
        if name in ("tp", "cp", "ep"):
            print(f"{'':<16}  {where_launched()}")
        if name == "muon":
            print(f"{'':<16}  CPU figures ({DDP_PROCESSES} gloo processes): not GPU ones")
        if name == "cp":
            longest_sequences()
        if name in ("bf16", "fp16") and workload.DEVICE == "cpu":
            print(f"{'':<16}  CPU figures (autocast on the CPU): they say nothing of a GPU")
        if name == "gpt2":
            print_gpt2_figures(speeds)


if __name__ == "__main__":
    main()
