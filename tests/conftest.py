from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from helpers import ROOT, on_cpu
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from slurm_cluster import Cluster, start_cluster, stop_cluster

from src.config.schema import register_configs

torch.set_num_threads(1)  # as in every process the tests start (helpers.QUIET_AND_FRUGAL says why)


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
