"""The in-process stage cut (`parallel=hybrid`: DDP over pipelines): each dp_replicate rank
runs the model cut into `parallel.stages` stages over its own devices.

`parallel.devices / parallel.stages` processes per node; process p drives GPUs
p * stages .. p * stages + stages - 1 (on CPU: `stages` CPU stages), where its copy of the model
is cut into stages as in `model_parallel` (`StageCut`: same split points, same micro-batching).
`replicated.Replicated` wraps each process's `Pipeline` under DDP as one multi-device module
(`device_ids=None`), which averages its gradients across the processes as it does for whole
replicas.
"""

from __future__ import annotations

import torch

from src.config.base import ConfigError
from src.config.parallel import MeshConfig
from src.parallel.stages.cut import StageCut


def check_no_stage_cut(cfg: MeshConfig) -> None:
    """ConfigError, in one line, for the stage cut beside tp, pp, cp or dp_shard (a mesh's
    layout, whose pipeline across processes is `parallel.pp`)."""
    if cfg.stages != 1:
        raise ConfigError(
            f"parallel.stages={cfg.stages} cuts each process's model over its own devices under "
            "dp_replicate alone (DDP); with tp, pp or dp_shard set, use parallel.pp for pipeline "
            "stages, or set parallel.stages=1"
        )


def stage_cut(cfg: MeshConfig, processes: int) -> StageCut | None:
    """The cut of `parallel.stages` stages in each of the job's `processes` replicas, None for
    one stage; ConfigError, in one line, in a job of one process."""
    if cfg.stages == 1:
        return None
    if processes == 1:
        raise ConfigError(
            f"parallel={cfg.name} with parallel.devices={cfg.devices} and parallel.stages="
            f"{cfg.stages} is a single process, with nothing to run data-parallel: use "
            f"parallel=model_parallel parallel.devices={cfg.stages}, or raise parallel.devices "
            "to a multiple of parallel.stages"
        )
    return StageCut(cfg, cfg.stages, "parallel.stages")


def stage_devices(device_type: str, local_rank: int, stages: int) -> list[torch.device]:
    """The `stages` devices of the process of `local_rank`."""
    if device_type == "cuda":
        # Modulo the visible GPUs: under `srun --gpus-per-task=<stages>` a rank sees its own.
        first = local_rank * stages % torch.cuda.device_count()
        return [torch.device("cuda", first + i) for i in range(stages)]
    return [torch.device("cpu")] * stages
