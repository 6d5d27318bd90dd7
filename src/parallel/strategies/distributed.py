"""The process-group part of `Mesh` and `Replicated` (every layout of one process per rank): the
group and its ranks.

Each process drives its `local_devices()` (`cuda:<local rank>` among the GPUs it sees, or the
CPU; under the stage cut, `Replicated` gives it its stages' devices) and joins a
torch.distributed process group: NCCL on CUDA, gloo on CPU, unless `parallel.backend` says
otherwise. The ranks are the job's `strategy.ranks` (`src/launch/as_rank.py` reads them once
from the environment that torchrun, srun or `launch` set); a job of one process has none.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from src.components.batches import Tree, move
from src.config.base import ConfigError
from src.config.parallel import DistributedConfig
from src.parallel.base import LossFn, Strategy
from src.parallel.devices import usable_cores
from src.parallel.sync_batchnorm import convert_sync_batchnorm
from src.runtime.ranks import Ranks

log = logging.getLogger(__name__)
ALONE = Ranks(rank=0, world_size=1, local_rank=0, local_world_size=1)  # a job of one process


def rank_threads(threads_per_rank: int | None, local_processes: int) -> tuple[int, str]:
    """Intra-op threads for one rank, and why: ranks sharing the cores must not fight over them."""
    if threads_per_rank:
        return threads_per_rank, "parallel.threads_per_rank"
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    cores = usable_cores()
    return max(1, cores // local_processes), f"{cores} cores / {local_processes} local processes"


class Distributed(Strategy):
    settings_schema = DistributedConfig
    spans_nodes = True

    def __init__(self, cfg, device_type: str, precision: str = "fp32", ranks: Ranks | None = None):
        super().__init__(cfg, device_type, precision, ranks)
        self.backend = str(cfg.backend or ("nccl" if device_type == "cuda" else "gloo"))
        if self.backend == "nccl" and device_type != "cuda":
            raise ConfigError("parallel.backend=nccl needs CUDA devices; use gloo on CPU")
        self.processes_per_node = cfg.devices
        self.world_size = cfg.devices * cfg.nodes
        self.rank = 0
        self.local_rank = 0

    def with_batchnorm_synced(self, model: nn.Module) -> nn.Module:
        """`model` with SyncBatchNorm for BatchNorm when `parallel.sync_batchnorm` asks."""
        if not self.cfg.sync_batchnorm:
            return model
        return convert_sync_batchnorm(model, self.device_type)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_shard(self) -> int:
        return self.rank  # each process reads a share of its own

    @property
    def data_shards(self) -> int:
        return self.world_size

    def check_batch(self, micro_batch: int) -> None:
        super().check_batch(micro_batch)
        if micro_batch % self.data_shards:
            raise ConfigError(
                f"the global micro-batch (trainer.batch_size / trainer.accumulate = {micro_batch}) "
                f"does not split evenly over {self.data_shards} processes ("
                f"{self.processes_from_settings()}); change trainer.batch_size or parallel.devices"
            )

    def processes_from_settings(self) -> str:
        """How the settings give the number of processes, for messages."""
        return f"parallel.devices={self.cfg.devices} x parallel.nodes={self.cfg.nodes}"

    def setup(self) -> None:
        ranks = self.ranks or ALONE
        self.rank, self.local_rank = ranks.rank, ranks.local_rank
        self.devices = self.local_devices()
        self.device = self.devices[0]  # where this rank's collectives run
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        threads, reason = rank_threads(self.cfg.threads_per_rank, ranks.local_world_size)
        torch.set_num_threads(threads)
        devices = ", ".join(str(device) for device in self.devices)
        log.info("%s, %s, %d intra-op thread(s) (%s)", devices, self.backend, threads, reason)
        timeout = timedelta(seconds=self.cfg.timeout_s)
        if self.ranks is not None:
            dist.init_process_group(self.backend, init_method="env://", timeout=timeout)
        else:  # a job of one process: nobody to meet
            dist.init_process_group(
                self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )

    def local_devices(self) -> list[torch.device]:
        """`cuda:<local rank>`, or the CPU (call after `setup` has read the local rank). A rank
        that sees fewer GPUs than there are local ranks (`srun --gpus-per-task=1`) sees its own
        only: local rank modulo the visible GPUs."""
        if self.device_type == "cuda":
            return [torch.device("cuda", self.local_rank % torch.cuda.device_count())]
        return [torch.device("cpu")]

    def apply(self, model: nn.Module, inputs: Tree, targets: Tree, fn: LossFn) -> torch.Tensor:
        return fn(model(move(inputs, self.device)), move(targets, self.device))

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        # A copy on the device the backend works on (NCCL: the GPU), so the caller's is untouched.
        reduced = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(reduced)
        return reduced.to(tensor.device)

    def barrier(self) -> None:
        dist.barrier(device_ids=[self.device.index] if self.backend == "nccl" else None)

    def peak_memory_mb(self, *cpu_mb: Callable[[], float]) -> tuple[list[str], list[list[float]]]:
        """Every rank's devices, in rank order (one gather for all the measures)."""
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.local_peak_memory_mb(*cpu_mb))
        labels = [label for rank_labels, _ in gathered for label in rank_labels]
        megabytes = [
            [mb for _, rank_measures in gathered for mb in rank_measures[measure]]
            for measure in range(len(cpu_mb))
        ]
        return labels, megabytes

    def local_peak_memory_mb(
        self, *cpu_mb: Callable[[], float]
    ) -> tuple[list[str], list[list[float]]]:
        labels, megabytes = super().local_peak_memory_mb(*cpu_mb)
        if self.device_type == "cuda" and self.cfg.nodes > 1:
            labels = [f"rank{self.rank}:{label}" for label in labels]
        return labels, megabytes

    def teardown(self) -> None:
        # A failing rank (an exception on its way through `train`) leaves its group open until
        # the process exits: its peers then fail only after it has reported its failure (see
        # `as_rank.run_as_rank`), so that the launcher names this rank rather than one of them.
        if dist.is_initialized() and sys.exc_info()[0] is None:
            dist.destroy_process_group()
