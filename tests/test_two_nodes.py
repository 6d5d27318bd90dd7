"""Two nodes on one machine: two network namespaces made here, each a host with an address of its
own on a bridge, each running `train.py` (or `torchrun`) as one node of a `parallel.nodes=2` job
over gloo."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import (
    TINY_SGD,
    TrainRun,
    assert_same_training,
    network_namespace,
    parallel_config,
    processes_of_session,
    reference_run,
    wait_until,
)
from test_resume import RESUMABLE

from src.config.base import ConfigError
from src.config.parallel import node_range
from src.launch.job import check_started_ranks, started_nodes
from src.launch.store_answers import STORE_ANSWER_S
from src.parallel import build_strategy
from src.runtime.ranks import Ranks

SUBNET = "10.213.0"
PORTS = iter(range(29611, 29700))  # the namespaces are this test's own: no other listener
# Both hosts share this machine's host name, which resolves to a loopback address: gloo must be
# told which interface reaches the other node, as in any container.
NODE_ENV = {"GLOO_SOCKET_IFNAME": "eth0"}


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts() -> Iterator[list[str]]:
    """Two network namespaces on a bridge, at SUBNET.1 and SUBNET.2: their names."""
    tag = f"pt{os.getpid()}"
    with contextlib.ExitStack() as namespaces:
        names = [namespaces.enter_context(network_namespace(f"{tag}n{node}")) for node in (1, 2)]
        try:
            ip("link", "add", f"{tag}br", "type", "bridge")
            ip("link", "set", f"{tag}br", "up")
            for node, name in enumerate(names, start=1):
                veth = f"{tag}v{node}"
                ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
                ip("link", "set", veth, "master", f"{tag}br", "up")
                inside = ("netns", "exec", name, "ip")
                ip(*inside, "addr", "add", f"{SUBNET}.{node}/24", "dev", "eth0")
                ip(*inside, "link", "set", "eth0", "up")
                ip(*inside, "link", "set", "lo", "up")
            yield names
        finally:  # the namespaces' removal removes the veth pairs with them
            subprocess.run(["ip", "link", "del", f"{tag}br"], capture_output=True)


def two_node_overrides(port: int, *overrides: str) -> tuple[str, ...]:
    return (
        "parallel.devices=1",
        "parallel.nodes=2",
        f"parallel.master_addr={SUBNET}.1",
        f"parallel.master_port={port}",
        "parallel.timeout_s=60",
        *overrides,
    )


def start_nodes(hosts: list[str], overrides: tuple[str, ...], run_dir: Path, **kwargs):
    """`train.py` on both hosts, one run folder (a cluster's shared file system); the first's
    output readable line by line."""
    env = {**NODE_ENV, **kwargs.pop("env", {})}
    second = TrainRun(*overrides, run_dir=run_dir, env=env, netns=hosts[1], **kwargs)
    first = TrainRun(*overrides, run_dir=run_dir, env=env, netns=hosts[0], one_page=True)
    return first, second


@pytest.mark.equivalence
def test_two_nodes_train_singles_weights(hosts, tmp_path):
    """fsdp; ddp on two nodes trains to single's weights in the next tests, which interrupt and
    resume it."""
    overrides = two_node_overrides(next(PORTS), "parallel=fsdp", *TINY_SGD)
    first, second = start_nodes(hosts, overrides, tmp_path)
    results = [first.finish(timeout=240), second.finish(timeout=240)]
    for result in results:
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "world_size=2" in results[0].stdout  # rank 0 on the first host: it sorts first
    assert_same_training(reference_run(*TINY_SGD), tmp_path)


@pytest.mark.equivalence
def test_killing_one_node_ends_the_job_on_the_other_and_it_resumes(hosts, tmp_path):
    """ddp on two nodes, from its start to single's weights."""
    # Rank 1 (the second host's) stops forever in its 4th step: the test kills that host's
    # processes there, after the checkpoint of step 2.
    faulty = ("model._target_=tests.faulty_models.FaultyMLP", "trainer.checkpoint_every=2")
    hang = {"FAULT": "hang", "FAIL_RANK": "1", "FAIL_AT_STEP": "4"}
    overrides = two_node_overrides(next(PORTS), "parallel=ddp", *TINY_SGD, *faulty)
    first, second = start_nodes(hosts, overrides, tmp_path, env=hang)
    first.wait_for("step 3/6")
    os.killpg(second.process.pid, signal.SIGKILL)
    killed = time.monotonic()
    result = first.finish(timeout=60)
    assert time.monotonic() - killed < 20, "the first node outlived its peer by 20 s"
    assert result.returncode != 0
    second.finish()

    resumed = (*overrides, "trainer.resume=auto")
    first, second = start_nodes(hosts, resumed, tmp_path, env={**hang, "FAIL_AT_STEP": "1000"})
    result, _ = (run.finish(timeout=240, check=True) for run in (first, second))
    assert "world_size=2" in result.stdout  # rank 0 on the first host: it sorts first
    assert "at step 2, learning rate" in (tmp_path / "train.log").read_text()
    assert_same_training(reference_run(*TINY_SGD), tmp_path)


def test_a_partition_ends_the_job_on_both_nodes_in_one_line_and_it_resumes(hosts, tmp_path):
    """The link between the hosts goes down mid-run: each node's rank gives up on its collective
    after parallel.timeout_s, and each node ends with one line naming the timeout and the peer.
    The far side's rank cannot reach the store to report (its launcher hosts none), so it and its
    launcher give up on the store after STORE_ANSWER_S each: 16.6 s measured with timeout_s=5."""
    timeout_s = 5
    longer = ("trainer.max_steps=60", "trainer.checkpoint_every=2")  # a page ahead at most
    overrides = two_node_overrides(
        next(PORTS), "parallel=ddp", *TINY_SGD, *longer, f"parallel.timeout_s={timeout_s}"
    )
    first, second = start_nodes(hosts, overrides, tmp_path)
    first.wait_for("step 3/60")
    with link_down(hosts[1]):
        down = time.monotonic()
        results = [first.finish(timeout=120), second.finish(timeout=120)]
        elapsed = time.monotonic() - down
    assert elapsed < timeout_s + 2 * STORE_ANSWER_S + 15, f"ended {elapsed:.0f} s after"
    assert_ended_in_one_line(first, results[0], f"{timeout_s} s", "rank 1 (node 2 of 2)")
    assert_ended_in_one_line(second, results[1], f"{timeout_s} s", "rank 0 (node 1 of 2)")

    command = results[0].stdout.rsplit("resume with:", 1)[1].split()
    assert command[-2:] == ["trainer.resume=auto", f"hydra.run.dir={tmp_path}"]
    first, second = start_nodes(hosts, (*overrides, "trainer.resume=auto"), tmp_path)
    for run in (first, second):
        run.finish(timeout=240, check=True)
    assert "resuming from" in (tmp_path / "train.log").read_text()
    assert_same_training(reference_run(*RESUMABLE), tmp_path)  # test_resume's: 60 steps too


def assert_ended_in_one_line(run: TrainRun, result, timeout: str, peer: str) -> None:
    """The node's launcher ended it (exit 1) with one line naming the collective's timeout and
    the peer, and no process of it runs 10 s later."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    (line,) = [line for line in output.splitlines() if line.startswith("[launcher]")][-1:]
    assert "[ERROR]" in line and f"a collective timed out after {timeout}" in line, line
    assert f"waiting for {peer}, which stopped answering" in line, line
    assert line.endswith("resume with:"), line
    assert "ChildFailedError" not in output and "Error executing job" not in output
    gone = wait_until(lambda: not processes_of_session(run.process.pid), within_s=10)
    assert gone, processes_of_session(run.process.pid)


@contextlib.contextmanager
def link_down(host: str) -> Iterator[None]:
    """`host`'s link to the bridge down (its veth's bridge end, as `hosts` names it), and up
    again after."""
    veth = host[: host.rindex("n")] + "v" + host[host.rindex("n") + 1 :]
    ip("link", "set", veth, "down")
    try:
        yield
    finally:
        ip("link", "set", veth, "up")


def test_torchrun_on_two_hosts_trains_singles_weights(hosts, tmp_path):
    port = next(PORTS)
    runs = []
    for node in (2, 1):
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={SUBNET}.1:{port}",
            f"--rdzv_id=two-hosts-{port}",
            f"--local_addr={SUBNET}.{node}",  # both hosts have this machine's name
            *(["--rdzv_conf=is_host=1"] if node == 1 else []),
            "--no-python",
        ]
        overrides = ("parallel=ddp", "parallel.devices=1", "parallel.nodes=2", *TINY_SGD)
        host = {"netns": hosts[node - 1], "prefix": tuple(torchrun)}  # torchrun in the namespace
        runs.append(TrainRun(*overrides, run_dir=tmp_path, env=NODE_ENV, **host))
    for run in runs:
        run.finish(timeout=240, check=True)
    assert_same_training(reference_run(*TINY_SGD), tmp_path)


ELASTIC_FAULTY = ("model._target_=tests.faulty_models.FaultyMLP", "trainer.checkpoint_every=2")
# The second host's rank 2 stops forever in step 4, after the checkpoint of step 2: the test kills
# that host's processes there.
SECOND_HOST_HANGS = {"FAULT": "hang", "FAIL_RANK": "2", "FAIL_AT_STEP": "4"}


def lose_second_node(hosts: list[str], overrides: tuple[str, ...], run_dir: Path, **first_env):
    """An elastic job of `overrides` on both hosts, 2 ranks each, whose second host's processes
    are killed in step 4: its first host's run, going on alone."""
    port = next(PORTS)
    overrides = (*two_node_overrides(port, *overrides), "parallel.devices=2", "parallel.nodes=1:2")
    env = {**NODE_ENV, **first_env}
    second = TrainRun(
        *overrides, run_dir=run_dir, env={**NODE_ENV, **SECOND_HOST_HANGS}, netns=hosts[1]
    )
    first = TrainRun(*overrides, run_dir=run_dir, env=env, netns=hosts[0], one_page=True)
    first.wait_for("step 3/6")
    os.killpg(second.process.pid, signal.SIGKILL)
    second.finish()
    return first, overrides


def reformed_line(output: str, change: str) -> str:
    """The launcher's line about the re-forming with `change` (`lost`, `joined`)."""
    (line,) = [line for line in output.splitlines() if f" {change} at step" in line]
    assert line.startswith("[launcher]"), line
    return line


@pytest.mark.equivalence
def test_an_elastic_job_that_loses_a_node_goes_on_on_the_other_to_singles_weights(hosts, tmp_path):
    """`parallel.nodes=1:2` under fsdp, 2 ranks per node, the second host's processes killed in
    step 4. The first host's ranks fail at once (their peers' connections reset); its launcher
    re-forms the job on itself alone within seconds and restarts its 2 ranks, which resume from
    step 2 resharded (sharded checkpoints) and finish with single's weights; one line and
    summary.json say what was lost. (ddp: the next test.)"""
    overrides = ("parallel=fsdp", *TINY_SGD, *ELASTIC_FAULTY)
    first, _ = lose_second_node(hosts, overrides, tmp_path)
    killed = time.monotonic()
    result = first.finish(timeout=120, check=True)
    line = reformed_line(result.stdout, "lost")
    assert f"node(s) {SUBNET}.2 lost at step 3: the job re-formed on 1 node(s)" in line, line
    assert "resumes from step 2 (1 step(s) redone)" in line, line
    (event,) = json.loads((tmp_path / "summary.json").read_text())["nodes_lost"]
    assert (event["lost"], event["joined"], event["nodes"]) == ([f"{SUBNET}.2"], [], 1), event
    assert (event["at_step"], event["resumed_from_step"], event["steps_redone"]) == (3, 2, 1)
    assert event["seconds_lost"] < 15, event
    assert time.monotonic() - killed < 60
    assert_same_training(reference_run(*TINY_SGD), tmp_path)


@pytest.mark.equivalence
def test_a_lost_node_that_comes_back_rejoins_the_elastic_job_at_its_next_step(hosts, tmp_path):
    """ddp, `parallel.rejoin=true`: once the job has re-formed on the first host alone, its
    restarted ranks wait in their first forward pass in training mode (PAUSE_IN_WORLD) while the
    second host's train.py starts again. The first host's launcher sees it waiting and stops its
    ranks: they finish step 3, checkpoint and exit (torch's agent reads no result of theirs
    then, and would kill them after its fixed 30 s), and the job restarts on both hosts from step
    3, nothing redone, within seconds, to single's weights. 10-27 s on 2 loaded cores."""
    overrides = ("parallel=ddp", *TINY_SGD, *ELASTIC_FAULTY, "parallel.rejoin=true")
    pause = {"PAUSE_IN_WORLD": "2", "PAUSE_AT_STEP": "1"}  # the world of the first host alone
    first, overrides = lose_second_node(hosts, overrides, tmp_path, **pause)
    # Its ranks restart after this line and pause within a second or two (in the check of the
    # model on the meta device), while the second host's train.py takes longer to join.
    first.wait_for(f"node(s) {SUBNET}.2 lost at step 3")
    back = TrainRun(*overrides, run_dir=tmp_path, env=NODE_ENV, netns=hosts[1])
    result = first.finish(timeout=120, check=True)
    back.finish(timeout=60, check=True)
    assert f"node(s) {SUBNET}.2 lost at step 3" in reformed_line(result.stdout, "lost")
    line = reformed_line(result.stdout, "joined")
    assert f"node(s) {SUBNET}.2 joined at step 3: the job re-formed on 2 node(s)" in line, line
    assert "resumes from step 3 (0 step(s) redone)" in line, line
    lost, joined = json.loads((tmp_path / "summary.json").read_text())["nodes_lost"]
    assert (lost["lost"], lost["nodes"], lost["steps_redone"]) == ([f"{SUBNET}.2"], 1, 1)
    assert (joined["joined"], joined["nodes"], joined["steps_redone"]) == ([f"{SUBNET}.2"], 2, 0)
    assert joined["seconds_lost"] < 15, joined  # not the agent's 30 s for ranks that have ended
    assert_same_training(reference_run(*TINY_SGD), tmp_path)


def test_ranks_started_on_fewer_nodes_of_an_elastic_job_are_accepted():
    """torchrun --nnodes=1:2 re-formed on one node: 2 ranks of parallel.devices=2 nodes=1:2."""
    strategy = build_strategy(parallel_config("ddp", devices=2, nodes="1:2"), "cpu")
    nodes = node_range("1:2")
    one_node = Ranks(rank=1, world_size=2, local_rank=1, local_world_size=2)
    assert started_nodes(one_node, nodes) == 1
    check_started_ranks(one_node, strategy, nodes)
    odd = Ranks(rank=0, world_size=3, local_rank=0, local_world_size=3)
    with pytest.raises(ConfigError, match="3 processes were started .* on 1 to 2 node"):
        check_started_ranks(odd, strategy, nodes)
