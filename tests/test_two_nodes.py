"""Two nodes on one machine: two network namespaces made here, each a host with an address of its
own on a bridge, each running `train.py` (or `torchrun`) as one node of a `parallel.nodes=2` job
over gloo."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TINY_SGD, TrainRun, assert_same_training, network_namespace, reference_run

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
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_nodes_train_singles_weights(hosts, strategy, tmp_path):
    overrides = two_node_overrides(next(PORTS), f"parallel={strategy}", *TINY_SGD)
    first, second = start_nodes(hosts, overrides, tmp_path)
    results = [first.finish(timeout=240), second.finish(timeout=240)]
    for result in results:
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "world_size=2" in results[0].stdout  # rank 0 on the first host: it sorts first
    assert_same_training(reference_run(*TINY_SGD), tmp_path)


def test_killing_one_node_ends_the_job_on_the_other_and_it_resumes(hosts, tmp_path):
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
    for run in (first, second):
        run.finish(timeout=240, check=True)
    assert "at step 2, learning rate" in (tmp_path / "train.log").read_text()
    assert_same_training(reference_run(*TINY_SGD), tmp_path)


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
