"""Datasets and the batch order shared by every strategy (image sets read by torchvision:
`test_vision.py`)."""

from __future__ import annotations

import functools
import itertools
import math
import resource
import time

import pytest
import torch
from helpers import (
    assert_same_training,
    metrics,
    reference_run,
    strategy_runs,
    summary,
    tokens_run,
    write_tokens,
)

from src.components.batch_order import Loading, SplitSamples, ValBatches, train_batches
from src.components.data import (
    synthetic_classification,
    synthetic_regression,
    synthetic_segmentation,
    synthetic_tokens,
    tokens,
)
from src.components.data_contract import Split, tokens_per_sample


def test_synthetic_data_is_a_function_of_the_seed():
    make = lambda seed: synthetic_classification(seed, 8, 3, 100, 0.2, 0.1)  # noqa: E731
    a, b, c = make(0), make(0), make(1)
    assert torch.equal(a.train.inputs, b.train.inputs) and torch.equal(a.val.targets, b.val.targets)
    assert not torch.equal(a.train.inputs, c.train.inputs)
    assert set(a.train.targets.tolist()) == {0, 1, 2}


def test_synthetic_tokens_are_a_function_of_the_seed():
    make = lambda seed: synthetic_tokens(seed, 50, 16, 64, 0.25, 0.1, successors=4)  # noqa: E731
    a, b, c = make(0), make(0), make(1)
    assert torch.equal(a.train.inputs, b.train.inputs) and torch.equal(a.val.targets, b.val.targets)
    assert not torch.equal(a.train.inputs, c.train.inputs)
    assert torch.equal(a.train.inputs[:, 1:], a.train.targets[:, :-1])  # targets: the next tokens


SYNTHETIC_SETS = {
    "classification": lambda seed, test_fraction=0.3: synthetic_classification(
        seed, 8, 3, 100, 0.2, test_fraction
    ),
    "tokens": lambda seed, test_fraction=0.3: synthetic_tokens(
        seed, 50, 16, 100, 0.2, test_fraction, successors=4
    ),
    "segmentation": lambda seed, test_fraction=0.3: synthetic_segmentation(
        seed, 3, [2, 4, 4], 100, 0.2, test_fraction, 0.1, -1
    ),
    "regression": lambda seed, test_fraction=0.3: synthetic_regression(
        seed, 8, 2, 100, 0.2, test_fraction
    ),
}


@pytest.mark.parametrize("kind", SYNTHETIC_SETS)
def test_synthetic_sets_draw_test_samples_of_their_own(kind):
    """data.test_fraction of num_samples more samples, none of them a training or validation
    sample, labelled by the same teacher; the training and validation samples are those of the
    same seed's set with another test_fraction."""
    data = SYNTHETIC_SETS[kind](0)
    assert (len(data.train), len(data.val), len(data.test)) == (80, 20, 30)

    def rows(split) -> set[tuple[float, ...]]:
        return {tuple(sample.flatten().tolist()) for sample in split.inputs}

    test = rows(data.test)
    assert len(test) == 30 and not test & rows(data.train) and not test & rows(data.val)
    assert data.test.targets.dtype == data.train.targets.dtype
    assert data.test.targets.shape[1:] == data.train.targets.shape[1:]
    assert not torch.equal(SYNTHETIC_SETS[kind](1).test.inputs, data.test.inputs)


def test_a_synthetic_test_split_leaves_training_and_validation_samples_as_they_were():
    fewer_tests = synthetic_classification(0, 8, 3, 100, 0.2, 0.05)
    data = synthetic_classification(0, 8, 3, 100, 0.2, 0.3)
    assert torch.equal(fewer_tests.train.inputs, data.train.inputs)
    assert torch.equal(fewer_tests.val.targets, data.val.targets)


@pytest.mark.parametrize("kind", SYNTHETIC_SETS)
def test_a_test_fraction_of_0_leaves_no_test_split_and_the_others_as_they_were(kind):
    """nanoGPT splits 90/10 with no test part: data.test_fraction=0 does the same."""
    builder = SYNTHETIC_SETS[kind]
    data = builder(0, test_fraction=0.0)
    with_tests = builder(0, test_fraction=0.3)
    assert data.test is None and data.splits == (data.train, data.val)
    assert torch.equal(data.train.inputs, with_tests.train.inputs)
    assert torch.equal(data.val.targets, with_tests.val.targets)
    with pytest.raises(ValueError, match="data.test_fraction must be at least 0 .* got -0.1"):
        builder(0, test_fraction=-0.1)


def successor_counts(vocab_size: int, successors: int) -> torch.Tensor:
    """How often each token follows each other token in a synthetic_tokens training set: a
    vocab x vocab count matrix (row: the token, column: the one after it)."""
    data = synthetic_tokens(0, vocab_size, 32, 2048, 0.1, 0.1, successors)
    pairs = data.train.inputs.flatten() * vocab_size + data.train.targets.flatten()
    return torch.bincount(pairs, minlength=vocab_size**2).view(vocab_size, vocab_size)


@pytest.mark.parametrize("successors", [1, 4])
def test_each_synthetic_token_has_a_few_successors_of_low_entropy(successors):
    """The chain is learnable: what follows a token is one of `successors` tokens (a dense chain
    had every token follow every other, at 60 000 pairs here), and its entropy, the loss a model
    can reach, is far below ln(vocab_size), a guess's loss."""
    counts = successor_counts(vocab_size=64, successors=successors).double()
    assert (counts.sum(1) > 0).all()
    assert (counts > 0).sum(1).max() <= successors
    shares = counts / counts.sum(1, keepdim=True)
    entropy = -(shares * shares.clamp_min(1e-12).log()).sum(1)
    mean_entropy = (entropy * counts.sum(1)).sum() / counts.sum()  # per predicted token
    assert mean_entropy < min(1.0, math.log(successors) + 1e-6)  # ln(64) = 4.16


def test_synthetic_tokens_at_gpt2_s_vocabulary_build_fast_in_little_memory():
    """50257 tokens: a dense transition matrix would take 10 GB and minutes to draw."""
    grown_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    data = synthetic_tokens(0, 50257, 256, 64, 0.1, 0.1, successors=4)
    assert time.perf_counter() - started < 5
    peak_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - grown_before) / 1024
    assert peak_growth_mb < 100
    assert data.num_classes == 50257 and data.input_shape == (256,)
    assert data.train.inputs.max() < 50257 and len(data.train.inputs.unique()) > 1000


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_batches_together_are_the_single_process_batch(world_size):
    data = synthetic_classification(0, 4, 3, 250, 0.1, 0.1)
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
    read = functools.partial(
        tokens, seed=0, path=str(tmp_path / "train.bin"), seq_len=8, val_fraction=0.1
    )
    data = read(vocab_size=None, test_fraction=0.2, test_path=None)
    assert data.num_classes == int(written.max()) + 1 and data.input_shape == (8,)
    assert len(data.train) == (700 - 1) // 8 and len(data.val) == (100 - 1) // 8
    assert len(data.test) == (200 - 1) // 8
    inputs, targets = data.train[3]
    assert inputs.tolist() == written[24:32].tolist()
    assert targets.tolist() == written[25:33].tolist()
    assert data.test[0][0].tolist() == written[700:708].tolist()  # the part before val
    assert data.val[0][0].tolist() == written[900:908].tolist()
    with pytest.raises(ValueError, match="data.vocab_size=5 but"):
        read(vocab_size=5, test_fraction=0.2, test_path=None)


def test_a_token_file_of_its_own_is_the_test_split(tmp_path):
    written = write_tokens(tmp_path / "train.bin", count=1000, vocab=13)
    test_file = tmp_path / "test.bin"
    test_tokens = (written[:200] + 13).astype(written.dtype)  # tokens the training file lacks
    test_tokens.tofile(test_file)
    data = tokens(0, str(tmp_path / "train.bin"), 8, None, 0.1, 0.2, str(test_file))
    assert len(data.train) == (900 - 1) // 8 and len(data.test) == (200 - 1) // 8
    assert data.test[0][0].tolist() == test_tokens[:8].tolist()
    assert data.num_classes == int(test_tokens.max()) + 1  # the vocabulary of both files


def test_a_token_file_with_a_test_fraction_of_0_trains_on_all_but_validation(tmp_path):
    write_tokens(tmp_path / "train.bin", count=1000, vocab=13)
    data = tokens(0, str(tmp_path / "train.bin"), 8, None, 0.1, 0.0, None)
    assert data.test is None and len(data.train) == (900 - 1) // 8


def test_tokens_per_sample_counts_inputs_of_token_ids_only(tmp_path):
    """A token file's windows (read through the Dataset path) count; features and uint8 images
    do not."""
    write_tokens(tmp_path / "train.bin", count=1000, vocab=13)
    windows = tokens(0, str(tmp_path / "train.bin"), 8, None, 0.1, 0.1, None)
    assert tokens_per_sample(windows.train) == 8
    assert tokens_per_sample(synthetic_classification(0, 8, 3, 100, 0.2, 0.1).train) is None
    images = Split(torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.long))
    assert tokens_per_sample(images) is None


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_through_the_loader_gives_the_in_memory_batches(num_workers):
    """A Dataset read by a DataLoader (with workers, from a resumed position too) gets the same
    batches as the in-memory fast path, and so the same sharding invariant."""
    data = synthetic_classification(0, 4, 3, 130, 0.1, 0.1)
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
