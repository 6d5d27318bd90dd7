"""The batch order every strategy shares, and reading batches in it.

`train_order` takes a rank and a world size, and its sharding is chosen so that the union of the
ranks' batches at step k is exactly the batch `single` sees at step k. An in-memory `Split` is
indexed where it lives; any other set (or an augmented one) is read through a `DataLoader` whose
batch sampler is that order.
"""

from __future__ import annotations

import functools
import math
import signal
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from src.components import batches
from src.components.batches import Tree
from src.components.data_contract import Batch, Split, Stream


def batches_per_epoch(num_samples: int, batch_size: int) -> int:
    return num_samples // batch_size


def train_order(
    num_samples: int,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    start_batch: int = 0,
    device: torch.device | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Endless (epoch, indices) of `batch_size // world_size` samples for `rank`.

    Each epoch is one permutation drawn from (seed, epoch), as `DistributedSampler` draws it,
    and rank r takes its positions r, r+W, r+2W, ...; so the ranks' k-th batches together are
    exactly the permutation's k-th block of `batch_size`, the batch a single process sees.
    Incomplete batches at the end of an epoch are dropped. Batch k is a function of (seed, k):
    `start_batch` starts there (resuming a run) without drawing the batches before it.
    """
    local = batch_size // world_size
    per_epoch = batches_per_epoch(num_samples, batch_size)
    if per_epoch == 0:
        raise ValueError(
            f"the training set has {num_samples} samples, fewer than one global batch of "
            f"{batch_size}: lower trainer.batch_size or use more data"
        )
    epoch, skip = divmod(start_batch, per_epoch)
    while True:
        generator = torch.Generator().manual_seed(seed + epoch)
        indices = torch.randperm(num_samples, generator=generator)[rank::world_size]
        indices = indices.to(device) if device is not None else indices
        for b in range(skip, per_epoch):
            yield epoch, indices[b * local : (b + 1) * local]
        epoch, skip = epoch + 1, 0


def val_order(num_samples: int, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank r's validation batches: every W-th sample in a fixed order, none twice, and as many
    batches as the rank with the most samples has (an empty batch where this rank has none)."""
    local = max(1, batch_size // world_size)
    indices = torch.arange(num_samples)[rank::world_size]
    most_per_rank = math.ceil(num_samples / world_size)
    return [indices[start : start + local] for start in range(0, most_per_rank, local)]


@dataclass(frozen=True)
class Loading:
    """How a `Dataset` (not an in-memory `Split`) is read; see `LoaderConfig`."""

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = True
    prefetch_factor: int = 2
    augment: Callable[[Batch, int, int], Batch] | None = None
    """Applied to (sample, epoch, index) of training samples; None: none."""

    def loader(self, dataset: Dataset, batch_sampler: Iterable) -> DataLoader:
        workers = self.num_workers > 0
        return DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=batches.collate,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=workers and self.persistent_workers,
            prefetch_factor=self.prefetch_factor if workers else None,
            worker_init_fn=leave_stop_signals_to_the_trainer if workers else None,
        )


def leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """Ctrl-C signals the whole process group, and a scheduler's SIGTERM often every process of
    the job: a worker that died of it would crash the training process ("DataLoader worker exited
    unexpectedly") before it could stop after the step and save. The training process stops its
    workers itself when it ends (and a worker whose parent is gone exits on its own)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class EpochSamples(Dataset):
    """A training set read by (epoch, index) keys, so that augmentation can draw from both."""

    def __init__(self, dataset: Dataset, augment: Callable[[Batch, int, int], Batch] | None):
        self.dataset, self.augment = dataset, augment

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Batch:
        epoch, index = key
        sample = self.dataset[index]
        return sample if self.augment is None else self.augment(sample, epoch, index)


class SplitSamples(Dataset):
    """An in-memory split as a Dataset (for augmentation, which the direct path does not do)."""

    def __init__(self, split: Split):
        self.split = split.to(torch.device("cpu"))

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> Batch:
        return self.split[index]


def loading_for(
    settings: Any, seed: int, device_type: str, processes_per_node: int, cores: int
) -> Loading:
    """`Loading` from the data settings (`LoaderConfig`). By default a CUDA run reads with up to
    4 workers per process (leaving a core to each training process) into pinned memory, whose
    host-to-device copies do not block; a CPU run reads in the training process, whose cores the
    workers would take."""
    cuda = device_type == "cuda"
    workers = settings.num_workers
    if workers is None:
        workers = min(4, max(0, cores // processes_per_node - 1)) if cuda else 0
    return Loading(
        num_workers=workers,
        pin_memory=cuda and settings.pin_memory,
        persistent_workers=settings.persistent_workers,
        prefetch_factor=settings.prefetch_factor,
        augment=augmentation(seed) if settings.augment else None,
    )


def augmentation(seed: int) -> Callable[[Batch, int, int], Batch]:
    """`data.augment=true`'s crop and flip (`src/components/augment.py`), drawn from (seed, epoch,
    index)."""
    from src.components.augment import augment_image  # torchvision, only for runs that augment

    return functools.partial(augment_image, seed)


def train_batches(
    dataset: Split | Dataset | Stream,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    start_batch: int = 0,
    loading: Loading = Loading(),
    position: dict[int, list[int]] | None = None,
) -> Iterator[Batch]:
    """Endless training batches for `rank` in `train_order`. An in-memory split is indexed where
    it lives (on a GPU: no copy per step); any other set, or an augmented one, goes through a
    DataLoader whose batch sampler is that order. A stream is read in its own order, in this
    process, from `position` (a checkpoint's; None: its start)."""
    if isinstance(dataset, Stream):
        return dataset.batches(batch_size, rank, world_size, start_batch, position)
    if isinstance(dataset, Split) and loading.augment is None:
        order = train_order(
            len(dataset), batch_size, seed, rank, world_size, start_batch, dataset.device
        )
        return (dataset[batch] for _, batch in order)
    if isinstance(dataset, Split):
        dataset = SplitSamples(dataset)
    order = train_order(len(dataset), batch_size, seed, rank, world_size, start_batch)
    keys = ([(epoch, index) for index in batch.tolist()] for epoch, batch in order)
    return iter(loading.loader(EpochSamples(dataset, loading.augment), keys))


class ValBatches:
    """The validation set as (inputs, targets, counted) batches for `rank`, read again each time
    it is iterated (a DataLoader's persistent workers stay up between evaluations).

    Every rank yields as many batches as the rank with the most samples: where the ranks' forward
    passes meet in collectives (fsdp gathers each block's parameters), they must run the same
    number. A rank short of samples pads with the set's first sample, yielded with
    `counted=False`: run through the model, left out of the figures.
    """

    def __init__(
        self,
        dataset: Split | Dataset,
        batch_size: int,
        rank: int,
        world_size: int,
        loading: Loading = Loading(),
    ):
        order = val_order(len(dataset), batch_size, rank, world_size)
        self.order = order  # each batch's sample indices (none for a padding batch)
        self.counted = [len(batch) > 0 for batch in order]
        padded = [batch if len(batch) else torch.zeros(1, dtype=torch.long) for batch in order]
        self.dataset = dataset
        if isinstance(dataset, Split):  # indexed where the split lives: no copies per batch
            self.indices = [batch.to(dataset.device) for batch in padded]
        else:
            self.loader = loading.loader(dataset, [batch.tolist() for batch in padded])

    def __iter__(self) -> Iterator[tuple[Tree, Tree, bool]]:
        if isinstance(self.dataset, Split):
            read = (self.dataset[batch] for batch in self.indices)
        else:
            read = iter(self.loader)
        for (inputs, targets), counted in zip(read, self.counted, strict=True):
            yield inputs, targets, counted
