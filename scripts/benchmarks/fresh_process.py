"""`single` and ddp x2 against hand-written loops, each side in a fresh process, as a harness
outside the template measures them (issue #44): the template through `python train.py`, the
hand-written loop as a script of its own (ddp's under torchrun), never in the benchmark's own
process, so that neither inherits what the other imported, compiled or warmed.

    python scripts/benchmarks/fresh_process.py --rounds 4          # single and ddp
    python scripts/benchmarks/fresh_process.py --only single --steps 400

The workload is `benchmark.py --only single`'s: MLP 784-1024-1024-10, batch 256, SGD, on
32768 in-memory samples. single runs with 2 intra-op threads, ddp with 1 per rank on 2 ranks
(OMP_NUM_THREADS, which both sides obey). The loop reads batches from a DataLoader over a
TensorDataset, as users write it. Both sides are timed alike: the median over windows of
`WINDOW_STEPS` steps (the template's default trainer.log_every) of each window's mean step, after
the first `WARMUP_STEPS`; the template's is its own `step_time_ms` (summary.json), and the loop
reads its loss once a window as the template logs it. (Timed otherwise, the loop's median single
step against the template logging every step, trainer.log_every=1, the template measured
0.92-0.96x; the figures are in docs/performance.md.) Rounds alternate which side goes first (ABAB)
and print the machine's load, since a loaded machine moves both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WARMUP_STEPS = 25
WINDOW_STEPS = 25  # the template's default trainer.log_every
WORKLOAD = (
    *("model=mlp", "model.hidden=1024", "model.depth=2"),
    *("data=synthetic", "data.input_dim=784", "data.num_samples=32768"),
    *("trainer.batch_size=256", "optimizer=sgd", "optimizer.schedule=constant"),
    *("optimizer.warmup_steps=0", "logger=none", "trainer.accelerator=cpu"),
)
# Threads per process: single's 2 on one process, ddp's 1 on each of its 2.
THREADS = {"single": 2, "ddp": 1}
PROCESSES = {"single": 1, "ddp": 2}

# The hand-written loop: the template's model, data and optimizer settings (composed from the
# same conf/), read through a DataLoader, each step timed; prints the median step in ms (rank 0).
PLAIN_LOOP = """
import json, os, statistics, sys, time
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
sys.path.insert(0, {root!r})
from src.components.data import build_data
from src.config.schema import register_configs

steps, warmup, window, overrides = {steps}, {warmup}, {window}, {overrides!r}
world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
if world > 1:
    import torch.distributed as dist
    dist.init_process_group("gloo")
register_configs()
with initialize_config_dir(config_dir={conf!r}, version_base="1.3"):
    cfg = compose("config", overrides=list(overrides))
data = build_data(cfg.data, cfg.seed)
torch.manual_seed(cfg.seed)
model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
if world > 1:
    model = torch.nn.parallel.DistributedDataParallel(model)
sgd = cfg.optimizer
optimizer = torch.optim.SGD(model.parameters(), lr=sgd.lr, momentum=sgd.momentum)
dataset = TensorDataset(data.train.inputs, data.train.targets)
sampler = DistributedSampler(dataset, drop_last=True) if world > 1 else None
loader = DataLoader(
    dataset, batch_size=cfg.trainer.batch_size // world, shuffle=sampler is None,
    sampler=sampler, drop_last=True,
)
batches = (batch for _ in iter(int, 1) for batch in loader)
window_ms = []
for step in range(steps):
    if step == warmup or (step > warmup and (step - warmup) % window == 0):
        if step > warmup:
            window_ms.append(1000 * (time.perf_counter() - started) / window)
        started = time.perf_counter()
    inputs, targets = next(batches)
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if (step + 1) % window == 0 and rank == 0:
        print(f"step {{step + 1}} loss {{loss.item():.4f}}")
if rank == 0:
    print(json.dumps({{"step_ms": statistics.median(window_ms)}}))
"""


def environment(layout: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(THREADS[layout])}


def template_step_ms(layout: str, steps: int) -> float:
    """The template's median step (ms) through `python train.py`, in a fresh process tree."""
    layout_overrides = [] if layout == "single" else ["parallel=ddp", "parallel.devices=2"]
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            *(sys.executable, "train.py", *WORKLOAD, *layout_overrides),
            *(f"trainer.max_steps={steps}", f"trainer.timing_warmup_steps={WARMUP_STEPS}"),
            *(f"trainer.log_every={WINDOW_STEPS}", "trainer.eval_every=0", "trainer.test=false"),
            f"hydra.run.dir={run_dir}",
        ]
        run(command, layout)
        return json.loads((Path(run_dir) / "summary.json").read_text())["step_time_ms"]


def plain_step_ms(layout: str, steps: int) -> float:
    """The hand-written loop's median step (ms), in a fresh process (2 under torchrun)."""
    script = PLAIN_LOOP.format(
        root=str(ROOT),
        conf=str(ROOT / "conf"),
        steps=steps,
        warmup=WARMUP_STEPS,
        window=WINDOW_STEPS,
        overrides=WORKLOAD,
    )
    with tempfile.TemporaryDirectory() as script_dir:
        path = Path(script_dir) / "plain_loop.py"
        path.write_text(script)
        if PROCESSES[layout] == 1:
            command = [sys.executable, str(path)]
        else:
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            command = [*torchrun, f"--nproc_per_node={PROCESSES[layout]}", str(path)]
        output = run(command, layout)
    return json.loads(output.strip().splitlines()[-1])["step_ms"]


def run(command: list[str], layout: str) -> str:
    ended = subprocess.run(
        command, cwd=ROOT, env=environment(layout), capture_output=True, text=True
    )
    if ended.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({ended.returncode}):\n{ended.stderr[-3000:]}")
    return ended.stdout


def compare(layout: str, rounds: int, steps: int) -> None:
    """ABAB rounds of the template and the loop; each round's step times, the load before it,
    and the medians and the ratio of medians (plain / template: above 1, the template is
    faster)."""
    sides = {"template": template_step_ms, "plain": plain_step_ms}
    times: dict[str, list[float]] = {side: [] for side in sides}
    loads = []
    for round_index in range(rounds):
        loads.append(os.getloadavg()[0])
        order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for side in order:
            times[side].append(sides[side](layout, steps))
        figures = "  ".join(f"{side} {times[side][-1]:.2f} ms" for side in sides)
        print(f"{layout} round {round_index + 1}: {figures}  (load {loads[-1]:.1f})", flush=True)
    template, plain = (statistics.median(times[side]) for side in sides)
    ratios = [p / t for t, p in zip(times["template"], times["plain"], strict=True)]
    print(
        f"{layout}: template {template:.2f} ms, plain {plain:.2f} ms per step (medians); "
        f"template speed / plain {plain / template:.3f} (rounds {min(ratios):.3f}-"
        f"{max(ratios):.3f}); load {min(loads):.1f}-{max(loads):.1f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(THREADS), action="append")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    for layout in args.only or sorted(THREADS, reverse=True):
        compare(layout, args.rounds, args.steps)


if __name__ == "__main__":
    main()
