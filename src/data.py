"""Datasets (in-memory tensors) and the batch order every strategy shares.

A builder returns `Data`: train and validation tensors plus the shapes a model needs. Data code
knows nothing about parallelism: `train_batches` takes a rank and a world size, and its sharding
is chosen so that the union of the ranks' batches at step k is exactly the batch `single` sees at
step k (see `train_batches`).
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import math
import os
import struct
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Split:
    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def nbytes(self) -> int:
        return self.inputs.nbytes + self.targets.nbytes

    def to(self, device: torch.device) -> Split:
        return Split(self.inputs.to(device), self.targets.to(device))


@dataclass
class Data:
    train: Split
    val: Split
    input_shape: tuple[int, ...]
    num_classes: int
    """Classes, or the vocabulary size for token data."""

    def to(self, device: torch.device) -> Data:
        return Data(self.train.to(device), self.val.to(device), self.input_shape, self.num_classes)


def _split(
    inputs: torch.Tensor, targets: torch.Tensor, num_classes: int, val_fraction: float, seed: int
) -> Data:
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction must be between 0 and 1, got {val_fraction}")
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(seed))
    num_val = max(1, int(len(targets) * val_fraction))
    val, train = order[:num_val], order[num_val:]
    return Data(
        train=Split(inputs[train], targets[train]),
        val=Split(inputs[val], targets[val]),
        input_shape=tuple(inputs.shape[1:]),
        num_classes=num_classes,
    )


def synthetic_classification(
    seed: int,
    input_dim: int,
    num_classes: int,
    num_samples: int,
    val_fraction: float,
    image_shape: list[int] | None = None,
) -> Data:
    """Gaussian inputs labelled by a random linear teacher: learnable, deterministic in the seed."""
    shape = tuple(image_shape) if image_shape else (input_dim,)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, *shape, generator=generator)
    teacher = torch.randn(inputs[0].numel(), num_classes, generator=generator)
    targets = (inputs.flatten(1) @ teacher).argmax(1)
    return _split(inputs, targets, num_classes, val_fraction, seed)


def synthetic_tokens(
    seed: int, vocab_size: int, seq_len: int, num_samples: int, val_fraction: float
) -> Data:
    """Sequences from a random, low-entropy bigram chain: next-token prediction is learnable."""
    generator = torch.Generator().manual_seed(seed)
    logits = 4.0 * torch.randn(vocab_size, vocab_size, generator=generator)
    transitions = logits.softmax(-1)
    tokens = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab_size, (num_samples,), generator=generator)
    for t in range(seq_len):
        next_token = torch.multinomial(transitions[tokens[:, t]], 1, generator=generator)
        tokens[:, t + 1] = next_token[:, 0]
    return _split(tokens[:, :-1], tokens[:, 1:], vocab_size, val_fraction, seed)


def synthetic_segmentation(
    seed: int,
    num_classes: int,
    image_shape: list[int],
    num_samples: int,
    val_fraction: float,
    ignore_fraction: float,
    ignore_index: int,
) -> Data:
    """Gaussian images whose pixels are labelled by a random linear teacher over each pixel's 3x3
    neighbourhood (a convolution learns it); `ignore_fraction` of the pixels, chosen at random,
    are labelled `ignore_index` instead. Targets: (samples, height, width) class ids."""
    if not 0 <= ignore_fraction < 1:
        raise ValueError(f"data.ignore_fraction must be in [0, 1), got {ignore_fraction}")
    generator = torch.Generator().manual_seed(seed)
    channels = image_shape[0]
    inputs = torch.randn(num_samples, *image_shape, generator=generator)
    teacher = torch.randn(num_classes, channels, 3, 3, generator=generator)
    targets = torch.nn.functional.conv2d(inputs, teacher, padding=1).argmax(1)
    ignored = torch.rand(targets.shape, generator=generator) < ignore_fraction
    targets[ignored] = ignore_index
    return _split(inputs, targets, num_classes, val_fraction, seed)


def synthetic_regression(
    seed: int, input_dim: int, output_dim: int, num_samples: int, val_fraction: float
) -> Data:
    """Gaussian inputs, targets from a random two-layer teacher plus a little noise:
    (samples, output_dim) floats. `num_classes` is the output width a model must have."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, input_dim, generator=generator)
    hidden = torch.randn(input_dim, 4 * output_dim, generator=generator) / input_dim**0.5
    teacher = torch.randn(4 * output_dim, output_dim, generator=generator) / (4 * output_dim) ** 0.5
    noise = 0.1 * torch.randn(num_samples, output_dim, generator=generator)
    targets = torch.tanh(inputs @ hidden) @ teacher + noise
    return _split(inputs, targets, output_dim, val_fraction, seed)


MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
MNIST_FILES = {"images": "train-images-idx3-ubyte", "labels": "train-labels-idx1-ubyte"}


def read_idx(path: Path) -> torch.Tensor:
    """Read an IDX file (MNIST's format), optionally gzipped."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim :]), dtype=torch.uint8).reshape(shape)


def _find_mnist_file(raw_dir: Path, stem: str, download: bool) -> Path:
    for candidate in (raw_dir / stem, raw_dir / f"{stem}.gz"):
        if candidate.exists():
            return candidate
    if not download:
        raise FileNotFoundError(
            f"MNIST file {stem}[.gz] not found in {raw_dir}; point data.root at the folder that "
            "holds MNIST/raw, or set data.download=true (needs network)"
        )
    target = raw_dir / f"{stem}.gz"
    url = MNIST_URL + target.name
    partial = target.with_name(f".{target.name}.part")  # never read as MNIST if cut short
    created = [folder for folder in (raw_dir, *raw_dir.parents) if not folder.exists()]
    raw_dir.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s", url)
    try:
        urllib.request.urlretrieve(url, partial)
    except OSError as error:  # URLError, a timeout, a full disk, ...
        partial.unlink(missing_ok=True)
        for folder in created:  # deepest first; a folder holding a finished file stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise FileNotFoundError(
            f"data.download=true could not fetch {url} ({getattr(error, 'reason', error)}); "
            f"check the network, or put MNIST's files into {raw_dir}"
        ) from error
    os.replace(partial, target)
    return target


def mnist(seed: int, root: str, download: bool, val_fraction: float) -> Data:
    """MNIST's training files from `root/MNIST/raw` (torchvision's layout), split into train/val."""
    raw_dir = Path(root).expanduser() / "MNIST" / "raw"
    images = read_idx(_find_mnist_file(raw_dir, MNIST_FILES["images"], download))
    labels = read_idx(_find_mnist_file(raw_dir, MNIST_FILES["labels"], download))
    inputs = (images.float().unsqueeze(1) / 255.0 - 0.1307) / 0.3081
    return _split(inputs, labels.long(), 10, val_fraction, seed)


def batches_per_epoch(num_samples: int, batch_size: int) -> int:
    return num_samples // batch_size


def train_batches(
    split: Split, batch_size: int, seed: int, rank: int, world_size: int, start_batch: int = 0
) -> Iterator[Batch]:
    """Endless shuffled batches of `batch_size // world_size` samples for `rank`.

    Each epoch is one permutation drawn from (seed, epoch) by `DistributedSampler`, which gives
    rank r the indices r, r+W, r+2W, ...; so the ranks' k-th batches together are exactly the
    permutation's k-th block of `batch_size`, the batch a single process sees. Incomplete batches
    at the end of an epoch are dropped. `start_batch` skips ahead (resuming a run).
    """
    local = batch_size // world_size
    per_epoch = batches_per_epoch(len(split), batch_size)
    if per_epoch == 0:
        raise ValueError(
            f"the training set has {len(split)} samples, fewer than one global batch of "
            f"{batch_size}: lower trainer.batch_size or use more data"
        )
    epoch, skip = divmod(start_batch, per_epoch)
    sampler = DistributedSampler(
        range(len(split)),
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=seed,
        drop_last=True,
    )
    while True:
        sampler.set_epoch(epoch)
        indices = torch.tensor(list(sampler), device=split.targets.device)
        for b in range(skip, per_epoch):
            batch = indices[b * local : (b + 1) * local]
            yield split.inputs[batch], split.targets[batch]
        epoch, skip = epoch + 1, 0


def val_batches(
    split: Split, batch_size: int, rank: int, world_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, bool]]:
    """The validation set in a fixed order as (inputs, targets, counted); rank r takes every
    W-th sample, none twice.

    Every rank yields as many batches as the rank with the most samples: where the ranks' forward
    passes meet in collectives (fsdp gathers each block's parameters), they must run the same
    number. A rank short of samples pads with the set's first sample, yielded with
    `counted=False`: run through the model, left out of the figures.
    """
    local = max(1, batch_size // world_size)
    indices = torch.arange(len(split), device=split.targets.device)[rank::world_size]
    most_per_rank = math.ceil(len(split) / world_size)
    for start in range(0, most_per_rank, local):
        batch = indices[start : start + local]
        if len(batch):
            yield split.inputs[batch], split.targets[batch], True
        else:
            yield split.inputs[:1], split.targets[:1], False
