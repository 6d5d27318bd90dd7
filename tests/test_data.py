"""Datasets, the real MNIST on-disk format, and the batch order shared by every strategy."""

from __future__ import annotations

import gzip
import itertools
import struct
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY,
    TINY_SGD,
    assert_same_training,
    metrics,
    reference_run,
    run_train,
    strategy_runs,
    summary,
    tokens_run,
    write_tokens,
)

from src.data import (
    Loading,
    Split,
    SplitSamples,
    ValBatches,
    augment_image,
    mnist,
    read_idx,
    synthetic_classification,
    tokens,
    train_batches,
)


def write_idx(path: Path, array: torch.Tensor, compress: bool) -> None:
    """Write `array` (uint8) in the IDX format MNIST ships in."""
    header = struct.pack(">HBB", 0, 0x08, array.dim()) + struct.pack(
        f">{array.dim()}I", *array.shape
    )
    payload = header + array.numpy().tobytes()
    path.write_bytes(gzip.compress(payload) if compress else payload)


def write_tiny_mnist(root: Path, samples: int = 200, compress: bool = True) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (samples, 28, 28), generator=generator, dtype=torch.uint8)
    labels = torch.randint(0, 10, (samples,), generator=generator, dtype=torch.uint8)
    suffix = ".gz" if compress else ""
    write_idx(raw / f"train-images-idx3-ubyte{suffix}", images, compress)
    write_idx(raw / f"train-labels-idx1-ubyte{suffix}", labels, compress)


@pytest.mark.parametrize("compress", [True, False])
def test_read_mnist_from_its_on_disk_format(tmp_path, compress):
    write_tiny_mnist(tmp_path, compress=compress)
    data = mnist(seed=0, root=str(tmp_path), download=False, val_fraction=0.1)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    assert len(data.train) == 180 and len(data.val) == 20
    labels = read_idx(next((tmp_path / "MNIST" / "raw").glob("train-labels*")))
    assert sorted(torch.cat([data.train.targets, data.val.targets]).tolist()) == sorted(
        labels.long().tolist()
    )


def test_missing_mnist_names_the_setting(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.root"):
        mnist(seed=0, root=str(tmp_path), download=False, val_fraction=0.1)


def test_convnet_trains_on_mnist_files_through_train_py(tmp_path):
    write_tiny_mnist(tmp_path / "data")
    tiny = [override for override in TINY if not override.startswith("data.")]
    run_train(
        *tiny,
        "model=convnet",
        "model.width=4",
        "data=mnist",
        f"data.root={tmp_path / 'data'}",
        run_dir=tmp_path / "run",
    )
    assert summary(tmp_path / "run")["steps"] == 6


def test_synthetic_data_is_a_function_of_the_seed():
    make = lambda seed: synthetic_classification(seed, 8, 3, 100, 0.2)  # noqa: E731
    a, b, c = make(0), make(0), make(1)
    assert torch.equal(a.train.inputs, b.train.inputs) and torch.equal(a.val.targets, b.val.targets)
    assert not torch.equal(a.train.inputs, c.train.inputs)
    assert set(a.train.targets.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_batches_together_are_the_single_process_batch(world_size):
    data = synthetic_classification(0, 4, 3, 250, 0.1)
    batch, steps = 12, 50  # 225 training samples: several epochs, with a dropped tail
    single = list(itertools.islice(train_batches(data.train, batch, 7, 0, 1), steps))
    ranks = [
        list(itertools.islice(train_batches(data.train, batch, 7, rank, world_size), steps))
        for rank in range(world_size)
    ]
    for step, (inputs, _) in enumerate(single):
        sharded = torch.cat([ranks[rank][step][0] for rank in range(world_size)])
        assert len(sharded) == batch
        assert sorted(map(tuple, sharded.tolist())) == sorted(map(tuple, inputs.tolist()))


@pytest.mark.parametrize(
    "samples, world_size, eval_batch",
    [(61, 2, 20), (61, 2, 2), (61, 2, 60), (61, 3, 7), (513, 2, 512), (1, 3, 4), (10, 4, 1)],
)
def test_every_rank_runs_as_many_eval_batches_and_each_sample_counts_once(
    samples, world_size, eval_batch
):
    split = Split(torch.arange(samples), torch.zeros(samples, dtype=torch.long))
    batches = [list(ValBatches(split, eval_batch, r, world_size)) for r in range(world_size)]

    assert len({len(rank_batches) for rank_batches in batches}) == 1
    assert all(len(inputs) > 0 for rank_batches in batches for inputs, _, _ in rank_batches)
    counted = [inputs for rank_batches in batches for inputs, _, counted in rank_batches if counted]
    assert sorted(torch.cat(counted).tolist()) == list(range(samples))


def test_token_file_windows_predict_every_next_token_once(tmp_path):
    written = write_tokens(tmp_path / "train.bin", count=1000, vocab=13)
    data = tokens(
        seed=0, path=str(tmp_path / "train.bin"), seq_len=8, vocab_size=None, val_fraction=0.1
    )
    assert data.num_classes == int(written.max()) + 1 and data.input_shape == (8,)
    assert len(data.train) == (900 - 1) // 8 and len(data.val) == (100 - 1) // 8
    inputs, targets = data.train[3]
    assert inputs.tolist() == written[24:32].tolist()
    assert targets.tolist() == written[25:33].tolist()
    assert data.val[0][0].tolist() == written[900:908].tolist()
    with pytest.raises(ValueError, match="data.vocab_size=5 but"):
        tokens(seed=0, path=str(tmp_path / "train.bin"), seq_len=8, vocab_size=5, val_fraction=0.1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_through_the_loader_gives_the_in_memory_batches(num_workers):
    """A Dataset read by a DataLoader (with workers, from a resumed position too) gets the same
    batches as the in-memory fast path, and so the same sharding invariant."""
    data = synthetic_classification(0, 4, 3, 130, 0.1)
    loading = Loading(num_workers=num_workers)
    for rank in range(2):
        direct = train_batches(data.train, 12, 7, rank, 2)
        through_loader = train_batches(SplitSamples(data.train), 12, 7, rank, 2, 5, loading)
        for expected, got in zip(itertools.islice(direct, 5, 25), through_loader, strict=False):
            assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_validation_through_the_loader_counts_each_sample_once_with_equal_forwards():
    split = Split(torch.arange(61), torch.zeros(61, dtype=torch.long))
    ranks = [
        list(ValBatches(SplitSamples(split), 20, r, 3, Loading(num_workers=2))) for r in range(3)
    ]
    assert len({len(batches) for batches in ranks}) == 1
    counted = [inputs for batches in ranks for inputs, _, counted in batches if counted]
    assert sorted(torch.cat(counted).tolist()) == list(range(61))


def test_augmentation_is_a_function_of_seed_epoch_and_index():
    image = torch.arange(2 * 8 * 8, dtype=torch.float).reshape(2, 8, 8)
    sample = (image, torch.tensor(1))
    first = augment_image(0, sample, 1, 5)[0]
    assert torch.equal(first, augment_image(0, sample, 1, 5)[0]) and first.shape == image.shape
    others = [augment_image(0, sample, epoch, 5)[0] for epoch in range(2, 12)]
    assert any(not torch.equal(first, other) for other in others)


@pytest.mark.equivalence
def test_token_file_trains_alike_for_any_worker_count_and_strategy(tmp_path):
    """`single` reading in-process, and `single`, `ddp` x2 and `fsdp` x2 reading with 2 workers
    per process, train the same weights (the loader's batches match the in-memory path's: see the
    test above)."""
    token_file = tmp_path / "train.bin"
    write_tokens(token_file)
    run = tokens_run(token_file)
    in_process = reference_run(*run, "data.num_workers=0")
    for run_dir in strategy_runs(*run, "data.num_workers=2", strategies=("ddp", "fsdp")).values():
        assert_same_training(in_process, run_dir)
    rows = [row for row in metrics(run_dir) if "train/loss" in row]
    assert len(rows) == 6 and all(row["train/data_wait_ms"] >= 0 for row in rows)
    assert summary(run_dir)["data_wait_ms"] >= 0


@pytest.mark.equivalence
def test_augmented_images_train_alike_for_any_worker_count_and_strategy(tmp_path):
    """Augmentation drawn from (seed, epoch, index): `single` with no workers and `ddp` x2 with 2
    workers each see the same augmented batches, so they train the same weights."""
    images = (
        *TINY_SGD,
        "model=convnet",
        "model.width=4",
        "data.image_shape=[1,8,8]",
        "data.augment=true",
    )
    run_train(*images, "data.num_workers=0", run_dir=tmp_path / "single")
    ddp = ("parallel=ddp", "parallel.devices=2")
    run_train(*images, *ddp, "data.num_workers=2", run_dir=tmp_path / "ddp")
    assert_same_training(tmp_path / "single", tmp_path / "ddp")
