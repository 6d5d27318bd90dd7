"""What a data builder returns (`Data`: train, validation and test sets and the shapes a model
needs), and what the loop asks of a set.

A set is a `Split` (in-memory tensors, indexed directly: no loader, no copies), any map-style
torch `Dataset` of (input, target) pairs, read through a `DataLoader`, or (for training) a
`Stream` read in order. Inputs and targets may each be a tensor or a tuple/dict of tensors
(`src/components/batches.py`); every path keeps that structure. Data code knows nothing about
parallelism: the order batches are read in, for any rank and world size, is
`src/components/batch_order.py`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from src.components import batches
from src.components.batches import Tree
from src.config.base import ConfigError

Batch = tuple[Tree, Tree]
"""(inputs, targets): each a tensor, or a tuple/dict of tensors."""


@dataclass
class Split:
    """A set held in memory: inputs and targets (tensors, or tuples/dicts of them) with the
    samples on dim 0."""

    inputs: Tree
    targets: Tree

    def __len__(self) -> int:
        return batches.batch_size(self.targets)

    @property
    def nbytes(self) -> int:
        return batches.nbytes((self.inputs, self.targets))

    @property
    def device(self) -> torch.device:
        return batches.tensors(self.targets)[0].device

    def __getitem__(self, index: Any) -> Batch:
        """The samples at `index` (an int, a slice or a tensor of indices)."""
        return batches.take(self.inputs, index), batches.take(self.targets, index)

    def to(self, device: torch.device) -> Split:
        return Split(*batches.move((self.inputs, self.targets), device))


class StreamReader(Iterator[Batch], ABC):
    """A `Stream`'s training batches for one rank, and where it has got to."""

    @abstractmethod
    def state_dict(self) -> dict[int, list[int]]:
        """The position of each part of the stream this rank reads, after the last batch it
        gave: what `Stream.batches` takes to go on from there."""


class Stream(ABC):
    """A training set read in order, from its start or a saved position: no length, no index.
    Its batches for rank r of W at step k are its own business; together, the ranks' batches
    at a step must be the batch a single process reads there."""

    @abstractmethod
    def batches(
        self,
        batch_size: int,
        rank: int,
        world_size: int,
        start_batch: int,
        position: dict[int, list[int]] | None,
    ) -> StreamReader:
        """Rank `rank`'s batches of `batch_size // world_size` samples from global batch
        `start_batch` on, which `position` (the ranks' `StreamReader.state_dict`s merged) says
        where to find; None: from the start."""

    @abstractmethod
    def check_shards(self, world_size: int) -> None:
        """Raise a ValueError if `world_size` ranks cannot share the stream."""

    def first(self, count: int) -> Batch:
        """The stream's first `count` samples, batched."""
        return next(self.batches(count, 0, 1, 0, None))


@dataclass
class Data:
    train: Split | Dataset | Stream
    val: Split | Dataset
    """Watched while training (evaluation steps, the best checkpoint, early stopping)."""
    test: Split | Dataset | None
    """Held out from training and from that watching: scored once, after training. None: the
    data has no test split (data.test_fraction=0)."""
    input_shape: tuple[int, ...]
    num_classes: int
    """Classes, or the vocabulary size for token data."""
    tokenizer: Any = None
    """Text data's tokenizer (`src/components/tokenizer.py`), which the run keeps in its folder;
    None for other data."""

    @property
    def splits(self) -> tuple[Split | Dataset, ...]:
        """The splits there are: train, val and, unless there is none, test."""
        return tuple(split for split in (self.train, self.val, self.test) if split is not None)

    def to(self, device: torch.device) -> Data:
        test = None if self.test is None else self.test.to(device)
        return replace(self, train=self.train.to(device), val=self.val.to(device), test=test)

    @property
    def in_memory(self) -> bool:
        return all(isinstance(split, Split) for split in self.splits)

    def first_train_samples(self, count: int) -> Data:
        """The same data, its training part cut to its first `count` samples (a stream's, held
        in memory)."""
        if isinstance(self.train, Stream):
            return replace(self, train=Split(*self.train.first(count)))
        if not 1 <= count <= len(self.train):
            raise ValueError(
                f"data.train_samples must be between 1 and the {len(self.train)} training "
                f"samples, got {count}"
            )
        if isinstance(self.train, Split):
            train = Split(*self.train[:count])
        else:
            train = Subset(self.train, range(count))
        return replace(self, train=train)


def first_samples(dataset: Split | Dataset | Stream, count: int) -> Batch:
    """The first `count` samples of a set, batched (on the host) as a DataLoader batches them."""
    if isinstance(dataset, Stream):
        return dataset.first(count)
    if isinstance(dataset, Split):
        return batches.move(dataset[:count], torch.device("cpu"))
    return batches.collate([dataset[index] for index in range(count)])


def meta_samples(dataset: Split | Dataset | Stream, count: int) -> Batch:
    """Inputs and targets shaped like `count` samples of the set, on the meta device."""
    return batches.meta_resized(first_samples(dataset, 1), count)


# Token ids: the index dtypes `nn.Embedding` takes (not uint8, which image files hold).
TOKEN_DTYPES = (torch.int32, torch.int64)


def tokens_per_sample(dataset: Split | Dataset | Stream) -> int | None:
    """Input tokens per sample: the elements of a sample's input when it is one tensor of token
    ids (`TOKEN_DTYPES`), as a language model's sequences are; None for any other input
    (features, images, tuples of tensors), of which tokens/s would mean nothing."""
    inputs, _ = first_samples(dataset, 1)
    if torch.is_tensor(inputs) and inputs.dtype in TOKEN_DTYPES:
        return inputs[0].numel()
    return None


def check_image_inputs(option: str, input_shape: Sequence[int]) -> None:
    """`option`'s model (a library's image model) takes images, channels first. Other inputs are
    refused by name here: the library's forward fails on them only inside its own code, which
    the up-front check on the meta device leaves to training (in launched ranks, after a
    traceback)."""
    if len(input_shape) != 3:
        raise ConfigError(
            f"{option} takes images shaped (channels, height, width), but the data's inputs are "
            f"shaped {list(input_shape)}; use an image data set (data=cifar10, mnist, "
            "image_folder, ...) or data=synthetic with data.image_shape=[3,32,32]"
        )
