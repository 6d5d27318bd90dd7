"""`parallel=ddp` through the real `train.py`: gloo process groups on CPU, NCCL where GPUs are."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.launcher.api as torch_launcher
from helpers import (
    ROOT,
    TINY,
    TINY_SGD,
    TrainRun,
    assert_same_training,
    checkpoint,
    evaluate_checkpoint,
    metrics,
    needs_gpus,
    on_cpu,
    parallel_config,
    pretend_gpus,
    proc_file,
    processes_of_session,
    rank_pids,
    reference_run,
    run_train,
    summary,
    wait_until,
)

import src.parallel.dp_replicate.apply
from src.components.models import MLP
from src.config.base import ConfigError
from src.launch.as_rank import adopt_slurm_environment, first_node
from src.launch.launcher import launch, launch_config
from src.parallel import build_strategy
from src.runtime.forking import start_rank_server
from src.runtime.ranks import Ranks
from src.training.build import check_config

DDP = ("parallel=ddp", "parallel.devices=2")


def log_lines(run_dir: Path) -> list[str]:
    """train.log's records (continuation lines of a multi-line message left out)."""
    return [line for line in (run_dir / "train.log").read_text().splitlines() if line[:1] == "["]


def val_losses(run_dir: Path) -> torch.Tensor:
    return torch.tensor([row["val/loss"] for row in metrics(run_dir) if "val/loss" in row])


def val_figures(run_dir: Path) -> torch.Tensor:
    """[val loss, val accuracy] per evaluation."""
    rows = [row for row in metrics(run_dir) if "val/loss" in row]
    return torch.tensor([[row["val/loss"], row["val/accuracy"]] for row in rows])


@pytest.mark.equivalence
def test_two_ddp_jobs_at_once_train_exactly_like_single(tmp_path):
    """Both jobs rendezvous on ports the OS picks, so they run side by side; the second one
    accumulates gradients (no_sync on the first micro-step) and logs to W&B."""
    with_wandb = (
        *(o for o in TINY_SGD if o != "logger=none"),
        "logger=wandb",
        "logger.wandb.mode=offline",
    )
    jobs = {"plain": TINY_SGD, "accumulate": (*with_wandb, "trainer.accumulate=2")}
    processes = [
        TrainRun(*overrides, *DDP, run_dir=tmp_path / name) for name, overrides in jobs.items()
    ]
    for process in processes:
        process.finish(check=True)
    assert_same_training(reference_run(*TINY_SGD), tmp_path / "plain")
    assert_same_training(reference_run(*TINY_SGD, "trainer.accumulate=2"), tmp_path / "accumulate")

    run_dir = tmp_path / "plain"
    expected_val = val_losses(reference_run(*TINY_SGD))
    torch.testing.assert_close(val_losses(run_dir), expected_val, rtol=0, atol=1e-5)
    result = summary(run_dir)
    assert result["strategy"] == "ddp" and result["world_size"] == 2
    assert result["memory_devices"] == ["cpu:rank0", "cpu:rank1"]
    assert result["global_batch"] == 24 and result["samples_per_sec"] > 0
    MLP(input_shape=(32,), num_classes=10, hidden=32, depth=3).load_state_dict(
        checkpoint(run_dir)["model"]
    )
    lines = log_lines(run_dir)
    assert all(re.match(r"\[(rank[01]|launcher)\]", line) for line in lines)
    assert any(line.startswith("[rank1]") for line in lines)
    assert sum("step 6/6" in line for line in lines) == 1, "one progress bar"
    assert sorted(path.name for path in run_dir.iterdir()) == [
        ".hydra",
        "checkpoints",
        "metrics.jsonl",
        "summary.json",
        "train.log",
    ]
    assert len(list((tmp_path / "accumulate").glob("wandb/offline-run-*"))) == 1


def run_faulty_job(
    tmp_path: Path, env: dict[str, str], timeout_s: int, give_up_after_s: int
) -> tuple[subprocess.CompletedProcess, float, int]:
    """A 2-rank ddp run of `tests.faulty_models.FaultyMLP` (faults set by `env`, collectives
    timing out after `timeout_s`); the result, how many seconds it took and its session."""
    started = time.monotonic()
    run = TrainRun(
        *TINY,
        *DDP,
        f"parallel.timeout_s={timeout_s}",
        "model._target_=tests.faulty_models.FaultyMLP",
        run_dir=tmp_path,
        env=env,
    )
    result = run.finish(timeout=give_up_after_s)
    return result, time.monotonic() - started, run.process.pid


@pytest.mark.parametrize(
    "fault, named_rank, error, within_s",
    [
        ("raise", 1, "failed: RuntimeError: injected failure in training step 3", 30),
        ("kill", 1, "was killed by SIGKILL", 30),
        # Rank 1 stops; rank 0's next collective gives up after parallel.timeout_s (5 s). The
        # stuck rank cannot answer the agent's SIGTERM, so torch's elastic agent SIGKILLs it
        # after its fixed 30 s grace for a failed worker group.
        (
            "hang",
            0,
            "failed: a collective timed out after 5 s (parallel.timeout_s) waiting for rank 1",
            60,
        ),
    ],
)
def test_failing_rank_stops_the_whole_job_and_is_named(
    tmp_path, fault, named_rank, error, within_s
):
    """One line from the launcher names the rank and what ended it, and the last checkpoint;
    neither torch's ChildFailedError report nor Hydra's."""
    env = {"FAIL_RANK": "1", "FAIL_AT_STEP": "3", "FAULT": fault}
    result, elapsed, session = run_faulty_job(tmp_path, env, timeout_s=5, give_up_after_s=60)

    console = result.stdout + result.stderr  # the log's lines go to stdout, tracebacks to stderr
    assert result.returncode == 1
    assert elapsed < within_s
    (line,) = [line for line in console.splitlines() if line.startswith("[launcher]")][-1:]
    assert f"[ERROR] - rank {named_rank} (pid " in line and error in line, console[-3000:]
    assert "the job stopped and no checkpoint was written; resume with:" in line
    assert "ChildFailedError" not in console and "Error executing job" not in console
    if fault == "hang":
        assert "Timed out waiting 5000ms" in line
    assert not (tmp_path / "summary.json").exists()
    assert processes_of_session(session) == []


def start_method_of_rank(ranks: Ranks, stop: Any) -> str:
    return multiprocessing.get_start_method()


def test_launched_ranks_start_their_processes_the_platforms_way():
    """A rank's own processes (DataLoader workers) start as under torchrun (fork on Linux), not
    through a forkserver of the rank's own, which imports torch again: seen, 5 s of data wait per
    rank and loader."""
    parallel = parallel_config("ddp")
    logging_config = {"version": 1, "disable_existing_loggers": False}
    platforms_way = multiprocessing.get_all_start_methods()[0]
    assert launch(start_method_of_rank, (), 2, 1, parallel, logging_config) == platforms_way


def environment_of_rank(name: str, ranks: Ranks, stop: Any) -> tuple[str | None, str]:
    return os.environ.get(name), os.environ["RANK"]


def test_launched_ranks_get_the_launchers_environment_at_launch(monkeypatch):
    """A variable the launcher set after its rank server started (a sweep's later job, with its
    `hydra.job.env_set`) reaches the ranks, beside what torch's agent sets for each."""
    start_rank_server()
    monkeypatch.setenv("TEMPLATE_TEST_SETTING", "set after the server started")
    parallel = parallel_config("ddp")
    logging_config = {"version": 1, "disable_existing_loggers": False}
    args = ("TEMPLATE_TEST_SETTING",)
    result = launch(environment_of_rank, args, 2, 1, parallel, logging_config)
    assert result == ("set after the server started", "0")


@dataclass
class TorchLaunchConfigBefore2_13:
    """The LaunchConfig fields `launch_config` sets, as torch 2.11 and 2.12 declare them: no
    `shutdown_timeout`."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: Any = None
    run_id: str = ""
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    max_restarts: int = 3
    start_method: str = "spawn"
    local_addr: str | None = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def test_launch_config_sets_the_shutdown_timeout_only_where_torch_takes_it(monkeypatch, tmp_path):
    parallel = parallel_config("ddp", timeout_s=45)
    installed = launch_config(2, 1, parallel, str(tmp_path))
    assert getattr(installed, "shutdown_timeout", 45) == 45  # torch 2.13 on
    monkeypatch.setattr(torch_launcher, "LaunchConfig", TorchLaunchConfigBefore2_13)
    older = launch_config(2, 1, parallel, str(tmp_path))
    assert (older.nproc_per_node, older.rdzv_configs["timeout"]) == (2, 45)


@pytest.mark.parametrize("moment", ["ranks started", "rendezvous"])
def test_ranks_end_within_seconds_when_the_launcher_is_killed(tmp_path, moment):
    """SIGKILL the launching train.py as soon as its rank processes exist, or
    when a rank logs its first line (it is about to meet the others in the process group):
    every process of the job (the ranks and multiprocessing's resource tracker) must be gone
    within seconds, or a requeued job would start beside them. (Killed while they train, the
    ranks always went at once.)"""
    launcher = TrainRun(*TINY, *DDP, run_dir=tmp_path, one_page=True)
    session = launcher.process.pid

    def job_processes() -> list[str]:
        return [proc_file(pid, "cmdline") for pid in processes_of_session(session)]

    try:
        if moment == "ranks started":
            assert wait_until(lambda: rank_pids(launcher.process.pid), within_s=120)
        else:
            launcher.wait_for("[rank")
        launcher.process.kill()
        launcher.finish()
        assert wait_until(lambda: not job_processes(), within_s=10), job_processes()
    finally:
        for pid in processes_of_session(session):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_rank_busy_when_its_peer_fails_is_stopped_at_once(tmp_path):
    """Rank 1 raises while rank 0 is computing, far from any collective. The launcher's SIGTERM
    must end rank 0 at once: a stop request would wait for parallel.timeout_s (60 s)."""
    env = {"FAIL_RANK": "1", "FAIL_AT_STEP": "3", "FAULT": "raise", "BUSY_RANK": "0"}
    result, elapsed, _ = run_faulty_job(tmp_path, env, timeout_s=60, give_up_after_s=120)

    console = result.stdout + result.stderr
    assert result.returncode == 1
    assert elapsed < 30
    assert "rank 1 (pid " in console
    assert "failed: RuntimeError: injected failure in training step 3" in console


def test_non_finite_loss_stops_every_rank_with_one_message(tmp_path):
    """The ranks agree on the step (the check is all-reduced), so this is the run's outcome, not
    a crash: the same one-line message and exit code as `single`, no traceback."""
    diverging = (
        "optimizer=sgd",
        "optimizer.lr=1000",
        "optimizer.warmup_steps=0",
        "trainer.checkpoint_every=2",
    )
    result = run_train(*TINY, *DDP, *diverging, run_dir=tmp_path, check=False)

    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "the training loss became non-finite at step 4" in output
    assert "Traceback" not in output
    assert checkpoint(tmp_path)["step"] == 2


@pytest.mark.equivalence
def test_ranks_started_by_torchrun_share_one_run_dir(tmp_path):
    """Each rank resolves `${now:...}` itself; all must still land in rank 0's directory."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
        *on_cpu((*TINY_SGD, *DDP, f"hydra.run.dir={tmp_path}/${{now:%H-%M-%S-%f}}")),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    assert_same_training(reference_run(*TINY_SGD), run_dir)
    lines = log_lines(run_dir)
    assert any(line.startswith("[rank1]") for line in lines)
    assert all(re.match(r"\[rank[01]\]", line) for line in lines)


@pytest.mark.equivalence
def test_ranks_started_by_srun_share_one_run_dir(tmp_path):
    """Two `train.py` processes with the variables `srun -n 2` sets; rank 0 hosts the store."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tasks = [
        TrainRun(
            *TINY_SGD,
            *DDP,
            run_dir=tmp_path / "${now:%H-%M-%S-%f}",
            env={
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "SLURM_NTASKS": "2",
                "SLURM_NNODES": "1",
                "SLURM_JOB_NODELIST": "localhost",
                "MASTER_PORT": str(port),
            },
        )
        for rank in (0, 1)
    ]
    for task in tasks:
        task.finish(check=True)
    (run_dir,) = tmp_path.iterdir()
    assert_same_training(reference_run(*TINY_SGD), run_dir)


BATCHNORM = (*TINY, "model._target_=tests.odd_models.BatchNormMLP", "trainer.accelerator=cpu")
HYBRID = ("parallel=hybrid", "parallel.devices=4", "parallel.stages=2")


@pytest.mark.parametrize("strategy", [DDP, HYBRID], ids=["ddp", "hybrid"])
def test_every_rank_evaluates_with_rank_0s_buffers_which_the_checkpoint_holds(tmp_path, strategy):
    """BatchNorm's running statistics: each rank updates them from its own samples, and DDP
    copies rank 0's to every rank before each forward pass, so the job's final validation
    figures are those of the model it saved."""
    run_train(*BATCHNORM, *strategy, run_dir=tmp_path)
    final = val_figures(tmp_path)[-1]
    torch.testing.assert_close(
        final, torch.tensor(evaluate_checkpoint(tmp_path)), rtol=0, atol=1e-5
    )


def test_without_broadcast_buffers_each_rank_keeps_its_own(tmp_path):
    run_train(*BATCHNORM, *DDP, "parallel.broadcast_buffers=false", run_dir=tmp_path)
    final = val_figures(tmp_path)[-1]
    assert (final[0] - evaluate_checkpoint(tmp_path)[0]).abs() > 1e-4


class TorchDDPBefore2_13(torch.nn.Module):
    """DistributedDataParallel's constructor as torch 2.11 (requirements.txt's floor) and 2.12
    declare it: no `forward_sync_buffers`."""

    def __init__(
        self,
        module,
        device_ids=None,
        output_device=None,
        dim=0,
        broadcast_buffers=True,
        init_sync=True,
        process_group=None,
        bucket_cap_mb=None,
        find_unused_parameters=False,
        check_reduction=False,
        gradient_as_bucket_view=False,
        static_graph=False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params=False,
    ):
        super().__init__()
        self.module, self.syncs_buffers = module, broadcast_buffers


class TorchDDP2_13(torch.nn.Module):
    """The same in torch 2.13: `broadcast_buffers` deprecated for `forward_sync_buffers`."""

    def __init__(
        self,
        module,
        device_ids=None,
        broadcast_buffers=None,
        forward_sync_buffers=None,
        bucket_cap_mb=None,
        find_unused_parameters=False,
        gradient_as_bucket_view=False,
        static_graph=False,
    ):
        super().__init__()
        if broadcast_buffers is not None:
            raise AssertionError("broadcast_buffers is deprecated in torch 2.13")
        self.module, self.syncs_buffers = module, forward_sync_buffers


@pytest.mark.parametrize("torch_ddp", [TorchDDPBefore2_13, TorchDDP2_13])
@pytest.mark.parametrize("broadcast", [True, False])
def test_ddp_passes_only_arguments_the_installed_torch_knows(monkeypatch, torch_ddp, broadcast):
    monkeypatch.setattr(src.parallel.dp_replicate.apply, "DistributedDataParallel", torch_ddp)
    strategy = build_strategy(parallel_config("ddp", broadcast_buffers=broadcast), "cpu")
    replica = strategy.replicate(MLP(input_shape=(4,), num_classes=2, hidden=4, depth=1), None)
    assert replica.syncs_buffers is broadcast


def test_batch_that_does_not_split_over_the_ranks_is_a_config_error(compose_config, tmp_path):
    cfg = compose_config(*DDP, "trainer.batch_size=25")
    with pytest.raises(ConfigError, match=r"trainer\.batch_size.*parallel\.devices"):
        check_config(cfg, tmp_path)


def test_under_srun_gpus_per_task_each_rank_drives_the_one_gpu_it_sees(
    monkeypatch, compose_config, tmp_path
):
    cfg = compose_config(*TINY, "parallel=ddp", "parallel.devices=4", "trainer.accelerator=cuda")
    pretend_gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"parallel\.devices=4 but only 1 GPU"):
        check_config(cfg, tmp_path)  # a job started here needs all four

    rank3 = Ranks(rank=3, world_size=4, local_rank=3, local_world_size=4)
    strategy = check_config(cfg, tmp_path, rank3)  # each rank needs one
    strategy.local_rank = 3
    assert strategy.local_devices() == [torch.device("cuda", 0)]
    pretend_gpus(monkeypatch, 4)  # all the node's GPUs visible to every rank
    assert strategy.local_devices() == [torch.device("cuda", 3)]


def test_a_model_with_lazy_modules_trains_like_single(tmp_path):
    """A LazyLinear gets its size from a forward pass before DDP (which refuses lazy modules)."""
    workload = (*TINY_SGD, "model._target_=tests.odd_models.LazyMLP")
    run_train(*workload, *DDP, run_dir=tmp_path)
    assert_same_training(reference_run(*workload), tmp_path)


def test_slurm_variables_become_torchrun_variables(monkeypatch):
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[07-09,12]",
        "MASTER_PORT": "29555",
    }
    monkeypatch.setattr(os, "environ", slurm)
    adopt_slurm_environment()
    assert [os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")] == ["5", "8", "1"]
    assert os.environ["LOCAL_WORLD_SIZE"] == "4"
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("gpu07", "29555")
    assert first_node("node1,node2") == "node1"


@pytest.mark.cuda
@pytest.mark.equivalence
@needs_gpus(2)
def test_ddp_on_two_gpus_uses_nccl_and_one_gpu_per_rank(tmp_path):
    gpu = ("trainer.accelerator=cuda",)
    run_train(*TINY_SGD, *DDP, *gpu, run_dir=tmp_path)
    assert summary(tmp_path)["memory_devices"] == ["cuda:0", "cuda:1"]
    lines = log_lines(tmp_path)
    assert any(line.startswith("[rank1]") and "cuda:1, nccl" in line for line in lines)
    assert_same_training(reference_run(*TINY_SGD, *gpu), tmp_path)


@pytest.mark.cuda
@pytest.mark.equivalence
@needs_gpus(1)
def test_ddp_on_one_gpu_trains_in_process_like_single(tmp_path):
    gpu = ("trainer.accelerator=cuda",)
    run_train(*TINY_SGD, "parallel=ddp", "parallel.devices=1", *gpu, run_dir=tmp_path)
    assert summary(tmp_path)["memory_devices"] == ["cuda:0"]
    assert any("cuda:0, nccl" in line for line in log_lines(tmp_path))
    assert_same_training(reference_run(*TINY_SGD, *gpu), tmp_path)


# Composes the config as train.py does, then asks for the rank server as train.py does before it
# imports torch: prints whether a server runs, and whether torch had been imported by then.
EARLY_SERVER = """
import sys
from multiprocessing import forkserver
from hydra import compose, initialize_config_dir
from src.config.schema import register_configs
from src.launch.early_server import start_rank_server_early

register_configs()
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose("config", overrides=sys.argv[2:])
start_rank_server_early(cfg.parallel)
print(forkserver._forkserver._forkserver_pid is not None, "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    ("overrides", "environment", "started"),
    [
        (DDP, {}, True),
        (("parallel=fsdp", "parallel.devices=2"), {}, True),
        (("parallel=hybrid", "parallel.devices=4", "parallel.stages=2"), {}, True),
        (("parallel=ddp", "parallel.devices=1"), {}, False),
        (("parallel=dp", "parallel.devices=2"), {}, False),
        (("parallel=model_parallel", "parallel.devices=2"), {}, False),
        (DDP, {"RANK": "0", "WORLD_SIZE": "2"}, False),  # torchrun started the ranks
    ],
    ids=["ddp", "fsdp", "hybrid", "ddp-1", "dp", "model_parallel", "under-torchrun"],
)
def test_the_rank_server_starts_before_torch_is_imported_when_ranks_will_be_launched(
    overrides, environment, started, tmp_path
):
    command = [sys.executable, "-c", EARLY_SERVER, str(ROOT / "conf"), *overrides]
    env = {**os.environ, **environment}
    output = tmp_path / "printed"
    with output.open("w") as stdout:  # not a pipe: a server would hold it open while it imports
        subprocess.run(command, cwd=ROOT, env=env, stdout=stdout, timeout=60, check=True)
    assert output.read_text().split() == [str(started), "False"]
