"""What a one-step `python train.py` takes from start to exit, against its plain floors."""

from __future__ import annotations

import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.launched import DDP_PROCESSES
from benchmarks.workload import (
    ROOT,
)

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
