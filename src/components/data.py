"""The built-in data builders, and `build_data`, which calls the one `data._target_` names.
Each returns `src/components/data_contract.py`'s `Data`."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from src.components.data_contract import Data, Split
from src.components.targets import check_target
from src.components.token_files import TokenWindows, largest_token, stream_ranges, token_files
from src.config.data import data_builder_config
from src.runtime.progress import PhaseProgress

log = logging.getLogger(__name__)


def build_data(settings: DictConfig, seed: int) -> Data:
    """The `Data` that the data settings' builder (`_target_`) returns, its training part cut
    to `data.train_samples` when set."""
    builder = data_builder_config(settings)
    check_target("data", builder, "a data builder")
    data = instantiate(builder, seed=seed)
    count = settings.get("train_samples")  # absent from the configs of older checkpoints
    return data if count is None else data.first_train_samples(count)


def check_fraction(name: str, fraction: float) -> None:
    if not 0 < fraction < 1:
        raise ValueError(f"data.{name} must be between 0 and 1, got {fraction}")


def carved(split: Split, val_fraction: float, seed: int) -> tuple[Split, Split]:
    """(train, val): `val_fraction` of the split's samples (at least one), chosen from the seed,
    validate; the rest train."""
    check_fraction("val_fraction", val_fraction)
    order = torch.randperm(len(split), generator=torch.Generator().manual_seed(seed))
    num_val = max(1, int(len(split) * val_fraction))
    return Split(*split[order[num_val:]]), Split(*split[order[:num_val]])


# A synthetic set's test samples are drawn from a generator of their own, so that the training and
# validation samples stay what they were before sets had a test part. torch's CPU generator keeps
# 32 bits of its seed (2**32 + seed draws what seed draws), so the test seed is the run's seed moved
# by a large odd constant within them: no run of a seed below it draws these samples.
TEST_SEED_OFFSET = 0x9E3779B9


def test_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed + TEST_SEED_OFFSET) % 2**32)


def check_test_fraction(test_fraction: float) -> None:
    if not 0 <= test_fraction < 1:
        raise ValueError(
            f"data.test_fraction must be at least 0 (0: no test split) and below 1, got "
            f"{test_fraction}"
        )


def test_count(num_samples: int, test_fraction: float) -> int:
    """How many test samples a synthetic set of `num_samples` draws besides them: at least one,
    none at a `test_fraction` of 0."""
    check_test_fraction(test_fraction)
    return max(1, int(num_samples * test_fraction)) if test_fraction else 0


def _split(samples: Split, test: Split, num_classes: int, val_fraction: float, seed: int) -> Data:
    """A synthetic set: `samples` split into train and val (`carved`), and its `test` samples
    (none drawn: no test split)."""
    train, val = carved(samples, val_fraction, seed)
    test_split = test if len(test) else None
    return Data(train, val, test_split, tuple(samples.inputs.shape[1:]), num_classes)


def synthetic_classification(
    seed: int,
    input_dim: int,
    num_classes: int,
    num_samples: int,
    val_fraction: float,
    test_fraction: float,
    image_shape: list[int] | None = None,
) -> Data:
    """Gaussian inputs labelled by a random linear teacher: learnable, deterministic in the seed."""
    shape = tuple(image_shape) if image_shape else (input_dim,)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, *shape, generator=generator)
    teacher = torch.randn(inputs[0].numel(), num_classes, generator=generator)

    def labelled(inputs: torch.Tensor) -> Split:
        return Split(inputs, (inputs.flatten(1) @ teacher).argmax(1))

    test_inputs = torch.randn(
        test_count(num_samples, test_fraction), *shape, generator=test_generator(seed)
    )
    return _split(labelled(inputs), labelled(test_inputs), num_classes, val_fraction, seed)


# Scale of the random logits of each token's successors: softmax(2 * N(0, 1)) over 4 successors
# has a mean entropy of 0.77 nats, against ln(vocab_size) for a guess (10.8 at GPT-2's 50257).
SUCCESSOR_LOGIT_SCALE = 2.0


def synthetic_tokens(
    seed: int,
    vocab_size: int,
    seq_len: int,
    num_samples: int,
    val_fraction: float,
    test_fraction: float,
    successors: int,
) -> Data:
    """Sequences from a random, sparse, low-entropy bigram chain: each token is followed by one of
    `successors` tokens drawn from the seed, with probabilities drawn from it too, so next-token
    prediction is learnable down to the chain's entropy (well below ln(vocab_size)). The chain
    takes memory in proportion to vocab_size x successors (a dense one at GPT-2's vocabulary
    would take 10 GB), and each position of all sequences is drawn in one step."""
    if successors < 1:
        raise ValueError(f"data.successors must be at least 1, got {successors}")
    generator = torch.Generator().manual_seed(seed)
    next_tokens = torch.randint(vocab_size, (vocab_size, successors), generator=generator)
    logits = SUCCESSOR_LOGIT_SCALE * torch.randn(vocab_size, successors, generator=generator)
    cumulative = logits.softmax(-1).cumsum(-1)

    def sequences(count: int, generator: torch.Generator) -> Split:
        by_position = torch.empty(seq_len + 1, count, dtype=torch.long)  # rows: one step each
        by_position[0] = torch.randint(vocab_size, (count,), generator=generator)
        what = f"building {count} sequences of {seq_len} tokens"
        steps = logged_progress(range(seq_len), what, "token")
        for t in steps:
            current = by_position[t]
            draw = torch.rand(count, 1, generator=generator)
            # Inverse CDF over each token's successors; the clamp catches a cumsum ending below 1.
            choice = (cumulative[current] < draw).sum(1).clamp_(max=successors - 1)
            by_position[t + 1] = next_tokens[current, choice]
        tokens = by_position.T.contiguous()
        return Split(tokens[:, :-1], tokens[:, 1:])

    samples = sequences(num_samples, generator)
    test = sequences(test_count(num_samples, test_fraction), test_generator(seed))
    return _split(samples, test, vocab_size, val_fraction, seed)


def logged_progress(steps: range, what: str, unit: str = "") -> Iterator[int]:
    """`steps`, showing how far they have got when they run long (`src/runtime/progress.py`).
    Each process that builds the data shows its own (a builder does not know its rank), where
    its progress is shown at all (rank 0's)."""
    with PhaseProgress(what, len(steps), unit=unit) as progress:
        for step in steps:
            yield step
            progress.advance()


def tokens(
    seed: int,
    path: str,
    seq_len: int,
    vocab_size: int | None,
    val_fraction: float,
    test_fraction: float,
    test_path: str | None,
    dtype: str = "uint16",
) -> Data:
    """Token files (`src/components/token_files.py`: one, or a glob of shards, read as one
    sequence): the last `val_fraction` validates, the `test_fraction` before it tests (or the
    files `test_path` names, when given; at a `test_fraction` of 0 without it, none does), the
    rest trains. The vocabulary is `vocab_size`, by default the largest token + 1 (of the files
    read)."""
    del seed  # the order comes from the seed in `train_order`; the windows are fixed
    files = token_files("path", path, dtype)
    check_fraction("val_fraction", val_fraction)
    total = sum(file.count for file in files)
    num_val = int(total * val_fraction)
    val = TokenWindows(files, stream_ranges(files, total - num_val, num_val), seq_len)
    if test_path is None:
        check_test_fraction(test_fraction)
        num_test = int(total * test_fraction)
        num_train = total - num_val - num_test
        test_ranges = stream_ranges(files, num_train, num_test)
        test = TokenWindows(files, test_ranges, seq_len) if test_fraction else None
        largest = largest_token(files)
    else:
        test_files = token_files("test_path", test_path, dtype)
        num_train = total - num_val
        test_total = sum(file.count for file in test_files)
        test = TokenWindows(test_files, stream_ranges(test_files, 0, test_total), seq_len)
        largest = max(largest_token(files), largest_token(test_files))
    vocab_size = largest + 1 if vocab_size is None else vocab_size
    if largest >= vocab_size:
        raise ValueError(
            f"data.vocab_size={vocab_size} but the token files hold token {largest}; raise it to "
            f"at least {largest + 1} or leave it unset"
        )
    if len(val) == 0:
        raise ValueError(
            f"data.path={path} has {total} tokens: too few for one validation window "
            f"of data.seq_len={seq_len} + 1; raise data.val_fraction or lower data.seq_len"
        )
    if test is not None and len(test) == 0:
        where = f"data.test_path={test_path}" if test_path else f"data.path={path}'s test part"
        raise ValueError(
            f"{where} is too short for one test window of data.seq_len={seq_len} + 1; "
            f"{'give a longer file' if test_path else 'raise data.test_fraction'} or lower "
            "data.seq_len"
        )
    train = TokenWindows(files, stream_ranges(files, 0, num_train), seq_len)
    return Data(train, val, test, input_shape=(seq_len,), num_classes=vocab_size)


def synthetic_segmentation(
    seed: int,
    num_classes: int,
    image_shape: list[int],
    num_samples: int,
    val_fraction: float,
    test_fraction: float,
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

    def labelled(inputs: torch.Tensor, generator: torch.Generator) -> Split:
        targets = torch.nn.functional.conv2d(inputs, teacher, padding=1).argmax(1)
        ignored = torch.rand(targets.shape, generator=generator) < ignore_fraction
        targets[ignored] = ignore_index
        return Split(inputs, targets)

    test_draws = test_generator(seed)
    test_inputs = torch.randn(
        test_count(num_samples, test_fraction), *image_shape, generator=test_draws
    )
    samples, test = labelled(inputs, generator), labelled(test_inputs, test_draws)
    return _split(samples, test, num_classes, val_fraction, seed)


def synthetic_regression(
    seed: int,
    input_dim: int,
    output_dim: int,
    num_samples: int,
    val_fraction: float,
    test_fraction: float,
) -> Data:
    """Gaussian inputs, targets from a random two-layer teacher plus a little noise:
    (samples, output_dim) floats. `num_classes` is the output width a model must have."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples, input_dim, generator=generator)
    hidden = torch.randn(input_dim, 4 * output_dim, generator=generator) / input_dim**0.5
    teacher = torch.randn(4 * output_dim, output_dim, generator=generator) / (4 * output_dim) ** 0.5

    def labelled(inputs: torch.Tensor, generator: torch.Generator) -> Split:
        noise = 0.1 * torch.randn(len(inputs), output_dim, generator=generator)
        return Split(inputs, torch.tanh(inputs @ hidden) @ teacher + noise)

    test_draws = test_generator(seed)
    test_inputs = torch.randn(
        test_count(num_samples, test_fraction), input_dim, generator=test_draws
    )
    samples, test = labelled(inputs, generator), labelled(test_inputs, test_draws)
    return _split(samples, test, output_dim, val_fraction, seed)
