"""This process's input: its training, validation and test batches, read as `data.*` says, and
where an in-memory dataset lives."""

from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig

from src.components.batch_order import Loading, ValBatches, loading_for, train_batches
from src.components.data_contract import Data
from src.config.job import JobConfig
from src.parallel.base import Strategy
from src.parallel.devices import usable_cores
from src.training.step import TimedBatches

log = logging.getLogger(__name__)


def input_batches(
    job: JobConfig,
    strategy: Strategy,
    data: Data,
    start_step: int,
    position: dict[int, list[int]] | None = None,
) -> tuple[TimedBatches, ValBatches, ValBatches | None]:
    """This process's training batches from `start_step` on (a stream's from `position`, its
    checkpoint's), and its validation and test batches (None without a test split)."""
    cfg, trainer = job.cfg, job.trainer
    loading = input_loading(cfg, strategy)
    train = train_batches(
        data.train,
        trainer.batch_size // trainer.accumulate,
        cfg.seed,
        strategy.data_shard,
        strategy.data_shards,
        start_batch=start_step * trainer.accumulate,
        loading=loading,
        position=position,
    )
    val, test = (
        ValBatches(split, trainer.eval_batch, strategy.data_shard, strategy.data_shards, loading)
        if split is not None
        else None
        for split in (data.val, data.test)
    )
    return TimedBatches(train), val, test


def input_loading(cfg: DictConfig, strategy: Strategy) -> Loading:
    """How this process reads a `Dataset` (`data.num_workers`, ...; see `loading_for`)."""
    return loading_for(
        cfg.data, cfg.seed, strategy.device_type, strategy.processes_per_node, usable_cores()
    )


DEVICE_DATA_FRACTION = 0.1


def keep_on_device(data: Data, device: torch.device) -> Data:
    """On a GPU, an in-memory dataset that needs at most a tenth of its memory lives there: each
    batch is then an index on the device, with no host-to-device copy per step (a pageable copy
    of 3 MB or more blocks the host until the GPU's queue drains). Larger sets stay on the host
    and are copied batch by batch. Sets read through a DataLoader stay where they are."""
    if device.type != "cuda" or not data.in_memory:
        return data
    budget = DEVICE_DATA_FRACTION * torch.cuda.get_device_properties(device).total_memory
    if sum(split.nbytes for split in data.splits) > budget:
        log.info("the dataset stays in host memory; batches are copied to %s each step", device)
        return data
    return data.to(device)
