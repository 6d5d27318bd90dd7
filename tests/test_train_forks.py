"""The tests' forked `train.py` (tests/train_forks.py) is `python train.py` in all the tests see:
the same output files, console, exit statuses and signal handling as a new process."""

from __future__ import annotations

import os
import signal

import pytest
from helpers import TINY_SGD, TrainRun, metrics, network_namespace, run_train, train_losses
from train_forks import NETNS_DIR, ForkedProcess

NEW_PROCESS = {"TEST_FORKS": "0"}  # another environment than the preloader's: never forked


def started_as(run: TrainRun) -> str:
    return "fork" if isinstance(run.process, ForkedProcess) else "process"


@pytest.mark.parametrize("env", [None, NEW_PROCESS], ids=["fork", "process"])
def test_a_run_and_its_bad_input_end_the_same_either_way(env, tmp_path):
    run = TrainRun(*TINY_SGD, run_dir=tmp_path / "run", env=env)
    assert started_as(run) == ("fork" if env is None else "process")
    result = run.finish(check=True)
    assert "run summary" in result.stdout + result.stderr
    assert len(train_losses(tmp_path / "run")) == 6 and metrics(tmp_path / "run")[-1]["step"] == 6

    bad = run_train("trainer.batch_size=0", run_dir=tmp_path / "bad", env=env, check=False)
    assert bad.returncode == 2 and len((bad.stdout + bad.stderr).strip().splitlines()) == 1


def test_a_forked_run_trains_as_a_new_process_does(tmp_path):
    run_train(*TINY_SGD, run_dir=tmp_path / "fork")
    run_train(*TINY_SGD, run_dir=tmp_path / "process", env=NEW_PROCESS)
    assert train_losses(tmp_path / "fork") == train_losses(tmp_path / "process")


def test_a_forked_run_is_its_own_session_and_dies_by_its_signal(tmp_path):
    run = TrainRun(*TINY_SGD, "trainer.max_steps=60", run_dir=tmp_path, one_page=True)
    assert started_as(run) == "fork"
    run.wait_for("step 2/60")
    assert os.getsid(run.process.pid) == run.process.pid
    run.process.kill()
    assert run.finish().returncode == -signal.SIGKILL


def test_a_forked_run_joins_its_network_namespace(tmp_path):
    """As `ip netns exec` would put it (test_two_nodes.py's hosts reach each other so)."""
    overrides = (*TINY_SGD, "trainer.max_steps=60")
    with network_namespace(f"pt{os.getpid()}fork") as name:
        run = TrainRun(*overrides, run_dir=tmp_path, one_page=True, netns=name)
        assert started_as(run) == "fork"
        run.wait_for("step 2/60")
        joined = os.stat(f"/proc/{run.process.pid}/ns/net").st_ino
        run.process.kill()
        assert run.finish().returncode == -signal.SIGKILL
        assert joined == os.stat(NETNS_DIR / name).st_ino != os.stat("/proc/self/ns/net").st_ino


def test_a_run_forks_after_this_process_s_own_environment_changed(monkeypatch, tmp_path):
    """Code the tests run in-process sets variables (a launch, a compile): a new preloader."""
    monkeypatch.setenv("TEST_FORKS_CHANGED", "1")
    run = TrainRun(*TINY_SGD, run_dir=tmp_path)
    assert started_as(run) == "fork"
    assert run.finish(check=True).returncode == 0
