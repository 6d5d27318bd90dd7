"""Starting the rank server (`src.runtime.forking.start_rank_server`) early, from the entry
points, before they import torch."""

from __future__ import annotations

from typing import Any

from src.launch.as_rank import started_ranks
from src.runtime.forking import start_rank_server


def start_rank_server_early(parallel: Any) -> None:
    """Start the rank server before this process imports torch, when its settings say that ranks
    will be launched here: a strategy of one process per replica (`DistributedConfig`'s
    settings) on more than one device, outside torchrun and srun. The server's imports, torch's
    and the training code's, then overlap this process's own instead of following them (measured by
    `scripts/benchmark.py --only startup`). It is a guess from the settings alone, the
    strategy not being built yet: `launch` starts the server anyway if it is not running, and a
    server started for a job that turns out to run one process (hybrid with devices == stages)
    only imported for nothing."""
    from omegaconf import OmegaConf

    from src.config.base import ConfigError
    from src.config.parallel import DistributedConfig, node_range

    distributed = issubclass(OmegaConf.get_type(parallel) or object, DistributedConfig)
    try:
        processes = parallel.devices * node_range(parallel.nodes).most
    except ConfigError:  # the job's checks say so, in their one line
        return
    if distributed and processes > 1 and started_ranks() is None:
        start_rank_server()
