"""Run `train.py` for real and read back what a run wrote."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import itertools
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from train_forks import forked_train

ROOT = Path(__file__).resolve().parents[1]


def options(group: str) -> list[str]:
    """The options of a config group: `conf/<group>/*.yaml`."""
    return sorted(path.stem for path in (ROOT / "conf" / group).glob("*.yaml"))


# The N-D layouts on a DeviceMesh (src/parallel/strategies/mesh.py), tested in test_mesh.py,
# test_cp.py and test_ep.py: each one needs a model with tensor-parallel styles, enough blocks for
# its stages, attention (cp) or experts (ep), and 4 processes for the 2-D presets, so the sweeps
# over every strategy leave them out.
MESH_LAYOUTS = ("tp", "pp", "cp", "fsdp_tp", "fsdp_cp_tp", "fsdp_tp_pp", "mesh", "ep")
STRATEGIES = [option for option in options("parallel") if option not in ("auto", *MESH_LAYOUTS)]

# A few seconds per run on 2 CPU cores: small model, few steps, every step logged.
TINY = (
    "trainer.max_steps=6",
    "trainer.batch_size=24",
    "trainer.log_every=1",
    "trainer.eval_every=3",
    "trainer.timing_warmup_steps=1",
    "data.num_samples=600",
    "model.hidden=32",
    "model.depth=3",
    "logger=none",
    # The first steps under torch's MemTracker cost 0.5-1.5 CPU-s a multi-process run: counted
    # where a test reads the tensor peak.
    "trainer.count_tensor_memory=false",
)
TINY_TRANSFORMER = (
    *TINY,
    "model=transformer",
    "data=synthetic_tokens",
    "data.seq_len=8",
    "data.vocab_size=16",
    "model.depth=2",
    "model.heads=2",
)
# Workloads whose final weights are compared with `single`'s train with SGD, at full rate from the
# first step so that the weights move well past the tolerance. Under SGD a rounding difference in
# a gradient (another split of the batch, another order of a sum, another CPU's kernels) stays a
# rounding difference in the weights. AdamW divides each gradient by its own running magnitude, so
# a last-bit difference in a near-zero gradient can flip that weight's update: up to the learning
# rate per step (seen: 2e-5 after TINY_TRANSFORMER's 6 steps). Adam runs compare their losses.
SGD = ("optimizer=sgd", "optimizer.warmup_steps=0")
TINY_SGD = (*TINY, *SGD)
# A 2-block GPT on tiny synthetic token sequences, for runs compared with single's weights.
TINY_GPT_SGD = (
    *(override for override in TINY_SGD if not override.startswith("model.")),
    "model=gpt",
    "data=synthetic_tokens",
    "data.seq_len=8",
    "data.vocab_size=16",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
)
TINY_TRANSFORMER_SGD = (*TINY_TRANSFORMER, *SGD)

# SGD with clipping and accumulation: the scaler must unscale before clipping, and scale every
# micro-step's loss alike.
FP16 = (
    *TINY,
    "optimizer=sgd",
    "optimizer.warmup_steps=0",
    "trainer.accumulate=2",
    "trainer.grad_clip=0.05",
    "trainer.precision=fp16",
)
# fp16 keeps 11 significant bits; a different split of the batch rounds some activations the
# other way, which moves losses and weights by ~1e-5 here. 1e-3 (two fp16 ulps near 1) bounds it.
FP16_TOLERANCE = 1e-3


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip a `cuda` test unless `count` GPUs are visible."""
    return pytest.mark.skipif(
        gpu_count() < count, reason=f"needs {count} CUDA GPU(s), {gpu_count()} visible"
    )


def on_cpu(overrides: tuple[str, ...] | list[str]) -> list[str]:
    """The overrides, plus `trainer.accelerator=cpu` unless they choose the accelerator: the
    tests expect CPU processes (gloo, `cpu:rank0` memory labels, as many devices as asked for),
    and on a GPU machine `auto` would pick CUDA. `cuda` tests say `trainer.accelerator=cuda`."""
    chosen = any(override.startswith("trainer.accelerator=") for override in overrides)
    return [*overrides] if chosen else [*overrides, "trainer.accelerator=cpu"]


def train_command(*overrides: str, script: str = "train.py") -> list[str]:
    """`python train.py <overrides>` (or `script`'s), on the CPU unless the overrides say
    otherwise."""
    return [sys.executable, script, *on_cpu(overrides)]


# Environment of every test run: W&B quiet; one intra-op thread per process; inductor
# (trainer.compile) compiling in the process itself instead of starting a pool of compile workers
# in every process and rank, which on 2 cores cost more than the compiling. The suite runs two test
# files at once, so a process's second thread mostly waits for a core, spinning: the default run
# took 12.7 s on a quiet 2-core machine, 37.5 s beside two busy processes, 19.3 s there with one
# thread. (Ranks get one thread each on 2 cores anyway: `distributed.rank_threads`.)
QUIET_AND_FRUGAL = {
    "WANDB_SILENT": "true",
    "OMP_NUM_THREADS": "1",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}


class TrainRun:
    """`python train.py <overrides> hydra.run.dir=<run_dir>` (or `-m ... hydra.sweep.dir=<dir>`)
    started in the background, in its own session: the process group that a terminal's Ctrl-C
    would signal as a whole. The one way the tests start `train.py`.

    With `one_page=True`, stdout and stderr share a pipe of one page that `wait_for` reads line by
    line: once the test stops reading, the run can get at most a page of log lines (a few dozen
    steps) ahead and cannot finish first, so signal tests need no sleeps and have no races.
    `prefix` goes before the command (`torchrun ...`). `netns` runs it (and its prefix) in that
    network namespace (`network_namespace`): a forked run joins it itself, any other starts behind
    `ip netns exec <netns>`. `script="eval.py"` runs eval.py the same way, in `run_dir`;
    `script="plan.py"` plan.py, with neither folder."""

    def __init__(
        self,
        *overrides: str,
        script: str = "train.py",
        run_dir: Path | None = None,
        sweep_dir: Path | None = None,
        env: dict[str, str] | None = None,
        one_page: bool = False,
        prefix: tuple[str, ...] = (),
        netns: str | None = None,
    ):
        if sweep_dir is not None:
            command = [
                *train_command("-m", *overrides, script=script),
                f"hydra.sweep.dir={sweep_dir}",
            ]
        else:
            command = train_command(*overrides, script=script)
            command += [f"hydra.run.dir={run_dir}"] if run_dir is not None else []
        self.command = command = [*prefix, *command]
        stdout = stderr = subprocess.PIPE
        if one_page:
            read_end, stdout = os.pipe()
            fcntl.fcntl(stdout, fcntl.F_SETPIPE_SZ, 4096)
            stderr = subprocess.STDOUT
        base = {**os.environ, **QUIET_AND_FRUGAL}
        environment = {**base, **(env or {})}
        self.process = forked_train(command, base, environment, stdout if one_page else None, netns)
        if self.process is None:
            if netns is not None:
                self.command = command = ["ip", "netns", "exec", netns, *command]
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                stdout=stdout,
                stderr=stderr,
                env=environment,
                start_new_session=True,
            )
        self.lines: list[str] = []
        self.page = None
        if one_page:
            os.close(stdout)
            self.page = os.fdopen(read_end, "rb", buffering=0)  # unbuffered: reads one line only

    def wait_for(self, text: str, times: int = 1) -> None:
        """Read the output until `text` has appeared in `times` lines (`one_page` runs)."""
        while sum(text in line for line in self.lines) < times:
            line = self.page.readline().decode()
            assert line, f"train.py ended before printing {text!r}:\n{''.join(self.lines)}"
            self.lines.append(line)

    def finish(self, timeout: float = 300, check: bool = False) -> subprocess.CompletedProcess:
        """Wait for the exit code, reading the rest of the output (which unblocks the run).
        `one_page` runs return all their output as stdout. A run past `timeout` is killed with
        its whole session (its ranks too), as `subprocess.run` would kill it, before the error."""
        try:
            if self.page is None:
                output = self.process.communicate(timeout=timeout)
                stdout, stderr = (text.decode() for text in output)
            else:
                self.lines.append(self.page.read().decode())
                self.page.close()
                self.process.wait(timeout=timeout)
                stdout, stderr = "".join(self.lines), ""
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise
        result = subprocess.CompletedProcess(self.command, self.process.returncode, stdout, stderr)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(self.command)} exited {result.returncode}\n"
                f"stdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-4000:]}"
            )
        return result


@contextlib.contextmanager
def network_namespace(name: str) -> Iterator[str]:
    """A new network namespace `name` (`ip netns add`), deleted after with the interfaces moved
    into it; skips the test where `ip netns` is missing or not permitted."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip")
    added = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if added.returncode != 0:
        pytest.skip(f"ip netns is not permitted here: {added.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def proc_file(pid: int, name: str) -> str:
    """/proc/<pid>/<name> as text; empty once the process is gone."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def processes_of_session(session: int) -> list[int]:
    """The processes of the session `session` (a `TrainRun`'s pid: its session holds the launcher,
    rank server, ranks and their workers, but not what starts a session of its own, such as
    W&B's service) that still run: not those that have released their memory to exit (an empty
    command line), which nothing can stop any more."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # after the command's closing parenthesis: state, ppid, process group, session, ...
            sid = int(stat.read_text().rsplit(")", 1)[1].split()[3])
        except (OSError, IndexError):  # gone meanwhile
            continue
        if sid == session and proc_file(int(stat.parent.name), "cmdline"):
            pids.append(int(stat.parent.name))
    return pids


def wait_until(condition: Callable[[], bool], within_s: float) -> bool:
    """Poll `condition` until it holds or `within_s` has passed; whether it holds."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def rank_pids(launcher_pid: int) -> list[int]:
    """The rank processes of a multi-process job started by `launcher_pid` (train.py): forked by
    its rank server (`forking.start_rank_server`, multiprocessing's forkserver), a new interpreter
    or, in a preloaded run, a fork of the launcher (whose command line it keeps)."""

    def children(pid: int) -> list[int]:
        return [int(child) for child in proc_file(pid, f"task/{pid}/children").split()]

    def is_server(pid: int) -> bool:
        command = proc_file(pid, "cmdline")
        return "forkserver" in command or command == proc_file(launcher_pid, "cmdline")

    servers = [pid for pid in children(launcher_pid) if is_server(pid)]
    return [rank for server in servers for rank in children(server)]


def run_train(
    *overrides: str,
    run_dir: Path,
    check: bool = True,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`python train.py <overrides> hydra.run.dir=<run_dir>`, to the end."""
    return TrainRun(*overrides, run_dir=run_dir, env=env).finish(timeout, check)


def run_eval(
    *overrides: str, eval_dir: Path, check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python eval.py <overrides> hydra.run.dir=<eval_dir>`, to the end."""
    return TrainRun(*overrides, script="eval.py", run_dir=eval_dir).finish(timeout, check)


def run_plan(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python plan.py <overrides>`, to the end (it writes no run folder)."""
    return TrainRun(*overrides, script="plan.py").finish(timeout)


def run_sweep(
    *overrides: str, sweep_dir: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python train.py -m <overrides> hydra.sweep.dir=<sweep_dir>`, to the end."""
    return TrainRun(*overrides, sweep_dir=sweep_dir, env=env).finish(timeout)


def kill_and_resume(run_dir: Path, *overrides: str, reference: Path) -> None:
    """SIGKILL a run once step 6 is logged, resume it, and compare it with `reference`."""
    run = TrainRun(*overrides, run_dir=run_dir, one_page=True)
    run.wait_for("step 6/60")
    run.process.kill()  # SIGKILL: no handler, no clean-up
    returncode = run.finish().returncode
    assert returncode == -signal.SIGKILL
    assert not (run_dir / "summary.json").exists()
    saved_step = checkpoint(run_dir)["step"]
    assert 5 <= saved_step < 60

    result = run_train(*overrides, "trainer.resume=auto", run_dir=run_dir)

    resumed_from = run_dir / "checkpoints" / f"step-{saved_step:06d}"
    assert f"resuming from {resumed_from} at step {saved_step}" in result.stdout
    assert_same_training(reference, run_dir)  # every step's loss, and the final weights
    assert checkpoint(run_dir)["step"] == 60


# The runs that tests share (`reference_run`, `sweep_runs`) train once per test session, not once
# per pytest-xdist worker that asks for them: the first to ask trains it under a lock, the others
# wait for it and read its folder. (A run that failed leaves no mark, and the next to ask tries.)
SHARED_RUNS = Path(tempfile.gettempdir()) / (
    f"pytest-shared-runs-{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}"
)


def shared_run(kind: str, overrides: tuple[str, ...], train: Callable[[Path], None]) -> Path:
    """The folder of `train(folder)` for these overrides, trained once per test session."""
    SHARED_RUNS.mkdir(exist_ok=True)
    name = f"{kind}-{hashlib.sha1(repr(overrides).encode()).hexdigest()[:16]}"
    folder, done = SHARED_RUNS / name, SHARED_RUNS / f"{name}.done"
    with (SHARED_RUNS / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            train(folder)
            done.touch()
    return folder


@functools.cache
def reference_run(*overrides: str) -> Path:
    """A `parallel=single` run with these overrides, trained once per test session."""

    def train(run_dir: Path) -> None:
        run_train(*overrides, "parallel=single", run_dir=run_dir)

    return shared_run("reference", overrides, train)


def swept(overrides: tuple[str, ...]) -> dict[str, list[str]]:
    """The settings that a sweep's overrides sweep (`key=a,b`), with their values."""
    return {
        key: value.split(",")
        for key, _, value in (override.partition("=") for override in overrides)
        if "," in value and not value.startswith(("[", "{"))  # a list or dict is one value
    }


@functools.cache
def sweep_runs(*overrides: str) -> dict[str, Path]:
    """One `train.py -m` sweep (comma-separated values in `overrides`), run once per test session:
    every job's run folder, keyed by the job's swept overrides (`"parallel=ddp"`, or
    `"parallel=dp parallel.devices=3"` when two keys are swept). One process runs every job, and
    starts the ranks of those that have any: far less start-up than a `train.py` each."""

    def train(sweep_dir: Path) -> None:
        result = run_sweep(*overrides, sweep_dir=sweep_dir, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]

    sweep_dir = shared_run("sweep", overrides, train)
    settings = swept(overrides)
    runs = {}
    for job in sweep_dir.iterdir():
        if (job / ".hydra").is_dir():
            job_overrides = OmegaConf.load(job / ".hydra" / "overrides.yaml")
            key = " ".join(o for o in job_overrides if o.split("=")[0] in settings)
            runs[key] = job
    return runs


def resumed_sweep_runs(*overrides: str, resume: dict[str, Path]) -> dict[str, Path]:
    """`sweep_runs(*overrides)` in which the job with the swept settings `key` resumes the
    checkpoint `resume[key]`. A sweep crosses every value of each setting, so no job can be given
    a `trainer.resume` of its own: the path names the job's number (`${hydra:job.num}`) in a folder
    of links, numbered as Hydra's basic sweeper numbers its jobs (the product of the swept values,
    in the order given). A job left out of `resume` (one the sweep skips) has no link."""
    settings = swept(overrides)
    jobs = [
        " ".join(f"{key}={value}" for key, value in zip(settings, values, strict=True))
        for values in itertools.product(*settings.values())
    ]
    assert resume.keys() <= set(jobs), f"{set(resume) - set(jobs)} are not jobs of {jobs}"
    links = hashlib.sha1(repr((overrides, resume)).encode()).hexdigest()[:16]
    folder = SHARED_RUNS / f"resumes-{links}"
    folder.mkdir(parents=True, exist_ok=True)
    for number, job in enumerate(jobs):
        if job in resume:
            with contextlib.suppress(FileExistsError):  # made by another worker, the same link
                (folder / str(number)).symlink_to(resume[job])
    return sweep_runs(*overrides, f"trainer.resume={folder}/${{hydra:job.num}}")


# Every strategy but `single`, as its `conf/parallel/` option ships (2 devices; hybrid 2 pipelines
# of 2 stages).
BESIDES_SINGLE = tuple(name for name in STRATEGIES if name != "single")


def strategy_runs(*overrides: str, strategies: tuple[str, ...] = BESIDES_SINGLE) -> dict[str, Path]:
    """`overrides` trained under `single` and each of `strategies`, in one sweep (`sweep_runs`):
    the run folders by strategy."""
    runs = sweep_runs(*overrides, f"parallel={','.join(['single', *strategies])}")
    return {key.removeprefix("parallel="): run_dir for key, run_dir in runs.items()}


def strict_json(text: str) -> Any:
    """`text` read as every JSON reader reads it (jq, JavaScript's JSON.parse): Python's `NaN`
    and `Infinity` refused."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [strict_json(line) for line in lines]


def train_losses(run_dir: Path) -> list[float]:
    return [row["train/loss"] for row in metrics(run_dir) if "train/loss" in row]


def train_accuracies(run_dir: Path) -> list[float]:
    return [row["train/accuracy"] for row in metrics(run_dir) if "train/accuracy" in row]


def summary(run_dir: Path) -> dict[str, Any]:
    return strict_json((run_dir / "summary.json").read_text())


def checkpoint(run_dir: Path) -> dict[str, Any]:
    """The run's newest checkpoint, whole and in the full format (single's keys), whichever
    format it was written in."""
    from src.checkpoint.store import load_checkpoint, saved_checkpoints

    return load_checkpoint(saved_checkpoints(run_dir)[-1])


def evaluate_checkpoint(
    run_dir: Path, split: str = "val", checkpoint_dir: Path | None = None, averaged: bool = False
) -> list[float]:
    """The task's figures ([loss, accuracy] for classification) on `split` (val or test) of the
    run's newest checkpointed model (or of `checkpoint_dir`; `averaged`: its weight average),
    evaluated whole in this process on the data its config names."""
    from src.checkpoint.export import averaged_weights
    from src.checkpoint.store import load_checkpoint
    from src.components.data import build_data
    from src.config.base import typed
    from src.config.parallel import ParallelConfig
    from src.config.trainer import TrainerConfig
    from src.parallel import build_strategy
    from src.training.step import evaluate

    state = checkpoint(run_dir) if checkpoint_dir is None else load_checkpoint(checkpoint_dir)
    cfg = OmegaConf.create(state["config"])
    data = build_data(cfg.data, cfg.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    model.load_state_dict(averaged_weights(state) if averaged else state["model"])
    single = build_strategy(ParallelConfig(), "cpu")
    single.setup()
    batch = typed(TrainerConfig, cfg.trainer).eval_batch
    task = instantiate(cfg.task)
    held_out = getattr(data, split)
    figures = evaluate(single.wrap(model), single, task, held_out, batch, contextlib.nullcontext())
    return list(figures.values())


def assert_same_losses(reference: Path, other: Path, atol: float = 1e-5) -> None:
    """Same per-step training losses, and the same training accuracy (give or take a prediction
    that float noise flipped). This is what Adam runs of a few steps can promise on any CPU: a
    weight whose update rounding flipped (see `SGD`) had a near-zero gradient, so moving it by the
    learning rate moves the loss by about that gradient times the learning rate (seen: at most
    6e-7, over every strategy and three CPU kernel settings, with weights up to 2e-5 apart)."""
    expected, actual = train_losses(reference), train_losses(other)
    assert len(actual) == len(expected)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=0, atol=atol)
    expected, actual = train_accuracies(reference), train_accuracies(other)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=0, atol=0.05)


def assert_same_training(reference: Path, other: Path, atol: float = 1e-5) -> None:
    """Same losses (`assert_same_losses`) and final weights (max abs difference below `atol`).
    Both runs must have trained with SGD: under Adam, weights can drift by the learning rate."""
    for run_dir in (reference, other):
        optimizer = checkpoint(run_dir)["config"]["optimizer"]["name"]
        assert optimizer == "sgd", (
            f"{run_dir} trained with optimizer={optimizer}: compare weights of runs with "
            "helpers.SGD, and Adam runs with assert_same_losses"
        )
    assert_same_losses(reference, other, atol)
    assert_same_weights(reference, other, atol)


def assert_same_weights(reference: Path, other: Path, atol: float) -> None:
    """The same final weights: single's keys in single's order, each within `atol`."""
    expected_weights, actual_weights = checkpoint(reference)["model"], checkpoint(other)["model"]
    assert list(actual_weights) == list(expected_weights), "not single's keys in single's order"
    for key, weight in expected_weights.items():
        difference = (actual_weights[key].float() - weight.float()).abs().max().item()
        assert difference < atol, f"{key}: max abs difference {difference:.2e}"


def assert_goes_on_exactly(reference: Path, resumed: Path, steps: list[int]) -> None:
    """`resumed` logs `reference`'s losses of `steps` (those after the checkpoint it resumed)
    and ends at its weights (single's keys, in single's order, within 1e-5)."""
    losses = [
        {row["step"]: row["train/loss"] for row in metrics(run_dir) if "train/loss" in row}
        for run_dir in (reference, resumed)
    ]
    assert list(losses[1]) == steps
    expected = torch.tensor([losses[0][step] for step in losses[1]])
    torch.testing.assert_close(torch.tensor(list(losses[1].values())), expected, rtol=0, atol=1e-5)
    weights = [checkpoint(run_dir)["model"] for run_dir in (reference, resumed)]
    assert list(weights[1]) == list(weights[0])
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=1e-5)


def assert_same_optimizer_state(reference: Path, other: Path, atol: float = 1e-5) -> None:
    """The checkpoints' optimizer states hold the same tensors under the same (single's)
    parameter indices."""
    expected, actual = (checkpoint(run_dir)["optimizer"]["state"] for run_dir in (reference, other))
    assert actual.keys() == expected.keys()
    for index, state in expected.items():
        assert actual[index].keys() == state.keys()
        for name, value in state.items():
            torch.testing.assert_close(
                actual[index][name], value, rtol=0, atol=atol, msg=f"{index}.{name}"
            )


def pretend_gpus(monkeypatch: Any, count: int) -> None:
    """As far as the checks and the device mapping ask, this process sees `count` GPUs (a
    machine, or an srun task given only its own)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def wandb_records(run_dir: Path) -> list[Any]:
    """Every protobuf `Record` in the run's offline `.wandb` file.

    The file is W&B's LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB
    blocks of chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last); a block tail shorter than a chunk header is zero padding.
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/*run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        left_in_block = block - position % block
        if left_in_block < 7:
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The rows logged with `run.log`, values decoded from JSON."""
    rows = [r.history for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "history"]
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in row.item}
        for row in rows
    ]


def write_tokens(path: Path, count: int = 3000, vocab: int = 16) -> np.ndarray:
    """A flat uint16 token file, as nanoGPT's prepare scripts write `train.bin`."""
    token_ids = np.random.default_rng(0).integers(0, vocab, count).astype(np.uint16)
    token_ids.tofile(path)
    return token_ids


def tokens_run(token_file: Path) -> tuple[str, ...]:
    """TINY_SGD's transformer trained on a token file."""
    kept = [override for override in TINY_SGD if not override.startswith(("data.", "model."))]
    return (
        *kept,
        "model=transformer",
        "model.hidden=32",
        "model.depth=2",
        "model.heads=2",
        "data=tokens",
        f"data.path={token_file}",
        "data.seq_len=8",
    )


def parallel_config(option: str, **settings: Any) -> Any:
    """`cfg.parallel` as `train.py parallel=<option> parallel.<key>=<value> ...` composes it from
    the shipped `conf/` (in this process), for building a strategy directly."""
    from hydra import compose, initialize_config_dir

    from src.config.schema import register_configs

    register_configs()
    changed = [f"parallel.{key}={json.dumps(value)}" for key, value in settings.items()]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"parallel={option}", *changed]).parallel


def forked_ranks(rank_function: Callable[..., None], *args: object, processes: int = 2) -> None:
    """`rank_function(rank, *args)` in `processes` processes forked from the rank server, which
    has imported torch: a spawned rank spent seconds importing it."""
    import torch.multiprocessing as mp

    from src.runtime.forking import start_rank_server

    start_rank_server()
    mp.start_processes(rank_function, args=args, nprocs=processes, start_method="forkserver")


def write_trained_tiktoken(path: Path, text: str, size: int = 300) -> Path:
    """A `.tiktoken` file of GPT-2's kind (`data.tokenizer=` takes it offline): `size` ranks
    under GPT-2's pattern, trained on `text` by tiktoken's own small trainer."""
    from tiktoken._educational import bpe_train
    from tiktoken_ext.openai_public import r50k_pat_str

    from src.components.tokenizer import write_tiktoken_bpe

    write_tiktoken_bpe(bpe_train(text, size, r50k_pat_str, visualise=None), path)
    return path
