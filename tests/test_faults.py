"""Faults during training: a diverging loss stops the run (or its steps are skipped), W&B
failing never stops training, and a killed process of a multi-process job ends it, resumably."""

from __future__ import annotations

import contextlib
import http.server
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY,
    TINY_SGD,
    TrainRun,
    assert_same_training,
    checkpoint,
    proc_file,
    processes_of_session,
    rank_pids,
    reference_run,
    run_train,
    summary,
    train_losses,
    wait_until,
    wandb_history,
)

# SGD at lr=1000 blows the loss up to NaN at step 4 (deterministically, from the seed).
DIVERGING = (
    *TINY,
    "optimizer=sgd",
    "optimizer.lr=1000",
    "optimizer.warmup_steps=0",
    "trainer.checkpoint_every=2",
)


def test_non_finite_loss_stops_the_run_naming_the_step(tmp_path):
    result = run_train(*DIVERGING, run_dir=tmp_path, check=False)

    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert (
        "the training loss became non-finite at step 4; stopped, and the last checkpoint "
        "(step 2) is kept" in output
    )
    assert "trainer.skip_nonfinite=true" in output and "Traceback" not in output
    assert not (tmp_path / "summary.json").exists()
    state = checkpoint(tmp_path)
    assert state["step"] == 2
    assert all(weight.isfinite().all() for weight in state["model"].values())
    assert all(torch.isfinite(torch.tensor(train_losses(tmp_path))))  # no NaN was logged


def test_skip_nonfinite_skips_those_steps_and_finishes(tmp_path):
    result = run_train(*DIVERGING, "trainer.skip_nonfinite=true", run_dir=tmp_path)

    assert "step 4: non-finite loss, optimizer step skipped" in result.stdout
    assert summary(tmp_path)["skipped_steps"] == 3  # steps 4, 5 and 6
    state = checkpoint(tmp_path)
    assert state["step"] == 6
    assert all(weight.isfinite().all() for weight in state["model"].values())


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class FailingServer(http.server.BaseHTTPRequestHandler):
    """A W&B server that answers every request with an error."""

    def do_HEAD(self) -> None:
        self.send_response(500)
        self.end_headers()

    do_GET = do_POST = do_HEAD

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def wandb_server(kind: str) -> Iterator[str]:
    """The base URL of a W&B server that is not there (a closed port) or that fails."""
    if kind == "unreachable":
        yield f"http://127.0.0.1:{closed_port()}"
        return
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), FailingServer) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{server.server_port}"
        server.shutdown()


@pytest.mark.parametrize("server", ["unreachable", "failing"])
def test_wandb_server_that_cannot_take_the_run_means_an_offline_run_within_seconds(
    tmp_path, server
):
    """Unreachable, W&B would retry the server for `logger.wandb.init_timeout_s` (60 s) and then
    train without a run; instead the run logs offline at once, with one warning, and
    `wandb sync` can upload it later. A server that answers but fails gets init_timeout_s."""
    overrides = [o for o in TINY if o != "logger=none"]
    started = time.monotonic()
    with wandb_server(server) as url:
        result = run_train(
            *overrides,
            "logger=wandb",
            "logger.wandb.mode=online",
            *(["logger.wandb.init_timeout_s=3"] if server == "failing" else []),
            run_dir=tmp_path,
            env={
                "WANDB_MODE": "online",
                "WANDB_BASE_URL": url,  # the only address contacted
                "WANDB_API_KEY": "0" * 40,
                "WANDB_ERROR_REPORTING": "false",  # no crash reports sent elsewhere
                "WANDB__DISABLE_UPDATE_CHECK": "true",  # no version check against PyPI
                "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
            },
        )
    elapsed = time.monotonic() - started

    output = result.stdout + result.stderr
    assert elapsed < 40, f"took {elapsed:.0f} s"
    assert output.count("WARNING") == 1 and "logging to an offline run instead" in output, output
    assert summary(tmp_path)["steps"] == 6
    assert len(list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    if server == "unreachable":  # no online attempt: the offline run is the only run file
        history = [row for row in wandb_history(tmp_path) if "train/loss" in row]
        assert [row["_step"] for row in history] == list(range(1, 7))


# A ddp x2 run checkpointing at step 2, in which rank 1 kills a process of its job in step 3.
FAULTY_DDP = (
    *TINY_SGD,
    "parallel=ddp",
    "parallel.devices=2",
    "trainer.checkpoint_every=2",
    "model._target_=tests.faulty_models.FaultyMLP",
)


@pytest.mark.parametrize("fault", ["kill_server", "kill_launcher"])
def test_a_killed_rank_server_or_launcher_ends_the_job_and_the_same_command_resumes_it(
    tmp_path, fault
):
    """The rank server's death ends the job at once, with one line that names it and the last
    checkpoint; the launcher's (SIGKILL: nothing of it can speak) takes every other process of
    the job with it. Either way nothing is left running and the resumed run ends with the
    uninterrupted run's weights."""
    env = {"FAIL_RANK": "1", "FAIL_AT_STEP": "3", "FAULT": fault}
    run = TrainRun(*FAULTY_DDP, run_dir=tmp_path, env=env)
    result, session = run.finish(), run.process.pid

    gone = wait_until(lambda: not processes_of_session(session), within_s=10)
    assert gone, processes_of_session(session)
    output = result.stdout + result.stderr
    if fault == "kill_server":
        assert result.returncode == 1, output
        (line,) = [line for line in output.splitlines() if "[ERROR]" in line]
        assert "the rank server (pid " in line and "was killed by SIGKILL" in line, line
        assert line.endswith(
            f"the last checkpoint is {tmp_path}/checkpoints/step-000002; resume with:"
        )
        assert "ChildFailedError" not in output and "Error executing job" not in output
    else:
        assert result.returncode == -signal.SIGKILL, output
    assert checkpoint(tmp_path)["step"] == 2
    run_train(*FAULTY_DDP, "trainer.resume=auto", run_dir=tmp_path)
    assert_same_training(reference_run(*TINY_SGD), tmp_path)


# A ddp x2 run of 60 tiny steps, checkpointing every other step: what the chaos test kills.
CHAOS = (*TINY_SGD, "trainer.max_steps=60", "trainer.checkpoint_every=2")
CHAOS_VICTIMS = ("a rank", "the launcher", "the rank server")


def test_chaos_random_kills_each_end_the_job_and_the_same_command_resumes_to_the_same_weights(
    tmp_path,
):
    """Seeded chaos: five times, the same command is started and, at a random step after its
    last checkpoint, one of its processes (a rank, the launcher or the rank server, each at
    least once) is SIGKILLed. Each kill ends the job within 30 s and leaves nothing running; the
    same command then finishes the run with the uninterrupted run's weights. Measured (2 cores at
    load 13): each job ended within 0.4 s of its kill; 42 s in all, its reference run included."""
    chance = random.Random(45)
    command = (*CHAOS, "parallel=ddp", "parallel.devices=2", "trainer.resume=auto")
    victims = [*CHAOS_VICTIMS, *chance.choices(CHAOS_VICTIMS, k=2)]
    chance.shuffle(victims)
    for victim in victims:
        kill_mid_run(victim, command, tmp_path, chance)
    run_train(*command, run_dir=tmp_path)
    assert_same_training(reference_run(*CHAOS), tmp_path)


def kill_mid_run(
    victim: str, command: tuple[str, ...], run_dir: Path, chance: random.Random
) -> None:
    """Run `command` and SIGKILL `victim` at a random step after the last checkpoint; the job
    must end within 30 s and leave nothing running."""
    start = saved_step(run_dir)
    run = TrainRun(*command, run_dir=run_dir, one_page=True)
    run.wait_for(f"step {chance.randint(start + 1, start + 3)}/60 ")
    os.kill(victim_pid(victim, run.process.pid, chance), signal.SIGKILL)
    killed = time.monotonic()
    result = run.finish(timeout=30)
    gone = wait_until(lambda: not processes_of_session(run.process.pid), within_s=10)
    assert gone, f"{victim} killed: {processes_of_session(run.process.pid)} still run"
    assert time.monotonic() - killed < 30, f"{victim} killed: the job took 30 s to end"
    assert result.returncode != 0, f"{victim} killed, yet the job succeeded"


def saved_step(run_dir: Path) -> int:
    """The step of the run's newest complete checkpoint; 0 before the first."""
    names = [path.name for path in (run_dir / "checkpoints").glob("step-*")]
    return max((int(name.removeprefix("step-")) for name in names), default=0)


def victim_pid(victim: str, launcher: int, chance: random.Random) -> int:
    """The pid of `victim` (one of CHAOS_VICTIMS) in the job that `launcher` started."""
    rank = chance.choice(sorted(rank_pids(launcher)))
    if victim == "a rank":
        return rank
    if victim == "the launcher":
        return launcher
    return int(proc_file(rank, "stat").rsplit(")", 1)[1].split()[1])  # the rank's parent
