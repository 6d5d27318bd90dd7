from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers import ROOT, on_cpu
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from slurm_cluster import Cluster, start_cluster, stop_cluster

from src.config.schema import register_configs
from src.planning.calibration import VERSION, cache_path

torch.set_num_threads(1)  # as in every process the tests start (helpers.QUIET_AND_FRUGAL says why)

# The files whose tests take longest (SLURM's waits first, then by their measured time at -n 3),
# handed to pytest-xdist's workers first (`--dist loadfile`, without its reordering by test
# count), so that no worker is left running one of them alone at the end.
SLOWEST_FIRST = (
    "test_slurm.py",
    "test_mesh.py",
    "test_plan.py",
    "test_ep.py",
    "test_speed.py",
    "test_ddp.py",
    "test_two_nodes.py",
    "test_cp.py",
    "test_eval.py",
    "test_resume.py",
    "test_equivalence.py",
    "test_vision.py",
    "test_faults.py",
    "test_mesh_checkpoints.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(scope="session", autouse=True)
def seeded_calibration(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every CPU plan the tests make (sweep reports, `parallel=auto`, plan.py, in this process
    and the runs it starts) reads one calibration, measured on a quiet 2-core machine and kept in
    tests/fixtures, rather than this machine's: measuring takes 16 s alone, more under the
    suite's load, and was measured again whenever the load fell (`calibration.CALMER`). Kept by
    the figures' version: a new version needs a new file. The timing tests measure this
    machine's, in a cache of their own (test_step_time.py)."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    seeded = cache_path("cpu")
    seeded.parent.mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "fixtures" / f"calibration-v{VERSION}-cpu.json", seeded)


@pytest.fixture(scope="session")
def compose_config() -> Callable[..., DictConfig]:
    """Compose the shipped `conf/` with command-line style overrides, as `train.py` would (on the
    CPU unless the overrides choose the accelerator, as `helpers.run_train`)."""
    register_configs()

    def _compose(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose("config", overrides=on_cpu(overrides))

    return _compose


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A one-node SLURM cluster of this machine for the session (`tests/slurm_cluster.py`); the
    tests that use it are marked `needs_slurm()`, which skips them without SLURM's binaries."""
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        stop_cluster(cluster)
