"""A real SLURM cluster of one node (this machine, 2 CPUs), started for the tests that need one.

munged, slurmctld and slurmd run from a folder of their own, on ports the OS picked, with a
munge socket of their own: nothing of the machine's is touched, and several test sessions at
once each get their own cluster. Commands reach it through SLURM_CONF (`Cluster.env`). Accounting
is off, as on many small clusters (sacct answers with an error).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo")
START_TIMEOUT_S = 30


def missing_binaries() -> list[str]:
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]


def needs_slurm() -> pytest.MarkDecorator:
    missing = missing_binaries()
    return pytest.mark.skipif(
        bool(missing),
        reason=f"needs SLURM installed ({', '.join(missing)} not found; .ci/run installs "
        "munge, slurmctld, slurmd and slurm-client)",
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slurm_conf(folder: Path, node: str) -> str:
    """One node named as this machine, 2 CPUs, partition `debug`; no accounting, no cgroups
    (proctrack/linuxproc works in containers). A requeued job may start again within seconds:
    SLURM 22.05 holds it for cred_expire (120 s by default), later ones for requeue_delay, and
    the schedulers that start it then look every sched_interval and bf_interval (60 s, 30 s)."""
    return f"""\
ClusterName=tests
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket,cred_expire=5
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=sched_interval=1,bf_interval=1,requeue_delay=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=10
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    folder: Path
    env: dict[str, str]

    def run(self, *command: str) -> str:
        return subprocess.run(
            command, env={**os.environ, **self.env}, capture_output=True, text=True, check=True
        ).stdout

    def restart_controller(self) -> None:
        """Restart slurmctld (jobs go on running). It checks time limits, and sends the signals
        due before them, every 30 s from its start: from now on."""
        self.stop("slurmctld")
        self.run("slurmctld", "-i")
        self.wait_until(lambda states: bool(states))

    def wait_until(self, ready: Callable[[list[str]], bool]) -> None:
        """Until the node's states, as sinfo gives them, are `ready`."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if ready(self.run("sinfo", "--noheader", "--format=%T").split()):
                    return
            except subprocess.CalledProcessError:
                pass  # slurmctld not listening yet
            time.sleep(0.2)
        logs = [(self.folder / f"{name}.log").read_text()[-2000:] for name in DAEMONS]
        raise RuntimeError("the SLURM node did not come up:\n" + "\n".join(logs))

    def states_until_gone(self, job: str) -> set[str]:
        """The states squeue gives `job` until it has left the queue."""
        seen: set[str] = set()
        deadline = time.monotonic() + START_TIMEOUT_S
        while state := self.queue_state(job):
            seen.add(state)
            assert time.monotonic() < deadline, f"job {job} still queued: {seen}"
            time.sleep(0.2)
        return seen

    def queue_state(self, job: str) -> str:
        """squeue's state of `job`; empty once it has ended (or been forgotten)."""
        try:
            return self.run("squeue", "--noheader", "--format=%T", f"--jobs={job}").strip()
        except subprocess.CalledProcessError:  # "Invalid job id": purged
            return ""

    def stop(self, daemon: str) -> None:
        """Stop a daemon by the pid in its pid file, and wait until it has gone."""
        pid_file = self.folder / f"{daemon}.pid"
        if not pid_file.exists():
            return
        pid = int(pid_file.read_text())
        pid_file.unlink()
        try:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                    return  # exited; its parent has gone, so nobody reaps it
                time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, FileNotFoundError):
            pass


def start_cluster(folder: Path) -> Cluster:
    """munged, slurmctld and slurmd for a one-node cluster in `folder`, up and idle."""
    folder.chmod(0o755)  # munged wants its socket's folder reachable by everyone
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    cluster = Cluster(folder, {"SLURM_CONF": str(folder / "slurm.conf")})
    node = socket.gethostname().split(".")[0]  # `hostname -s`
    (folder / "slurm.conf").write_text(slurm_conf(folder, node))
    key = folder / "munge.key"
    cluster.run("mungekey", "--create", f"--keyfile={key}")
    key.chmod(0o600)
    cluster.run(
        "munged",
        "--force",  # as root
        f"--socket={folder}/munge.socket",
        f"--key-file={key}",
        f"--pid-file={folder}/munged.pid",
        f"--log-file={folder}/munged.log",
        f"--seed-file={folder}/munged.seed",
    )
    cluster.run("slurmctld", "-i")
    cluster.run("slurmd")
    cluster.wait_until(lambda states: states == ["idle"])
    return cluster


def stop_cluster(cluster: Cluster) -> None:
    """Cancel what is left of the tests' jobs, then stop the daemons."""
    everything = ["scancel", "--full", f"--user={os.getuid()}"]
    subprocess.run(everything, env={**os.environ, **cluster.env})
    for daemon in reversed(DAEMONS):
        cluster.stop(daemon)
