"""Schemas of `conf/data/`. A dataset builder returns `src.components.data_contract.Data`
(train/val/test sets plus their shapes). The loader settings are the loop's, not the builder's:
`data_builder_config` leaves them out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from src.config.base import choices

TokenDtype = choices("TokenDtype", "uint16 uint32", __name__)
SampleBy = choices("SampleBy", "document paragraph line", __name__)


@dataclass
class LoaderConfig:
    num_workers: int | None = None
    """DataLoader worker processes per training process, for sets not held in memory as tensors
    (token files) and for augmented ones; None: up to 4 on CUDA, 0 on CPU."""
    pin_memory: bool = True
    """On CUDA, read into pinned memory, so that host-to-device copies do not block the host."""
    persistent_workers: bool = True
    """Keep the workers between evaluations."""
    prefetch_factor: int = 2
    """Batches each worker reads ahead."""
    augment: bool = False
    """Image sets: a random crop and horizontal flip of each training sample, drawn from
    (seed, epoch, sample index), so every strategy and worker count sees the same batches."""
    train_samples: int | None = None
    """Train on the first N training samples only, over and over (debug=overfit: a model that
    cannot overfit a few batches will not learn the whole set); None: all of them."""


@dataclass
class DataConfig(LoaderConfig):
    _target_: str = MISSING
    val_fraction: float = 0.1
    """Share of the samples held out for validation, chosen from the seed."""
    test_fraction: float = 0.1
    """The test split's size. Synthetic sets draw this share of num_samples as test samples
    besides them, from a generator seeded apart (seed + 0x9E3779B9), so that train and val hold
    what they hold without it; a token file's test part is this share of its tokens, just
    before the validation part (unless `test_path` gives a file of its own). 0: no test split
    (as nanoGPT's 90/10 train/val), with trainer.test=false."""


@dataclass
class GaussianInputsConfig(DataConfig):
    """What the synthetic sets of Gaussian inputs (classification, regression) share."""

    input_dim: int = 32
    """Features per input, each drawn from a standard normal."""


@dataclass
class SyntheticConfig(GaussianInputsConfig):
    _target_: str = "src.components.data.synthetic_classification"
    num_classes: int = 10
    num_samples: int = 8192
    image_shape: list[int] | None = None
    """Set (e.g. [1, 16, 16]) to generate image-shaped inputs for `model=convnet`."""


@dataclass
class SyntheticTokensConfig(DataConfig):
    _target_: str = "src.components.data.synthetic_tokens"
    vocab_size: int = 64
    """Tokens are 0 .. vocab_size - 1."""
    seq_len: int = 32
    """Input tokens per sample; the targets are the tokens that follow each one."""
    num_samples: int = 4096
    successors: int = 4
    """Tokens that may follow each token (drawn from the seed, as are their probabilities): the
    chain's memory is vocab_size x successors, and a model's loss can fall to its entropy (0.77
    nats on average at 4), far below ln(vocab_size)."""


@dataclass
class SyntheticSegmentationConfig(DataConfig):
    _target_: str = "src.components.data.synthetic_segmentation"
    num_classes: int = 4
    image_shape: list[int] = field(default_factory=lambda: [3, 16, 16])
    num_samples: int = 1024
    ignore_fraction: float = 0.1
    """Share of the pixels labelled `ignore_index` (counted in no figure)."""
    ignore_index: int = -100
    """Keep it task.ignore_index (conf/data/synthetic_segmentation.yaml does)."""


@dataclass
class SyntheticRegressionConfig(GaussianInputsConfig):
    _target_: str = "src.components.data.synthetic_regression"
    output_dim: int = 4
    """Floats per target; the model's output width must match it."""
    num_samples: int = 4096


@dataclass
class TorchvisionSetConfig(LoaderConfig):
    """A set torchvision reads from its published files (`src/components/vision.py`): the test
    part tests, and the training part trains and validates."""

    _target_: str = MISSING
    val_fraction: float = 0.1
    """Share of the training part held out for validation, chosen from the seed."""
    root: str = "data"
    """Folder holding the set's files as torchvision lays them out (the option's file says
    where)."""
    download: bool = False
    """Fetch the files when missing, with torchvision; needs network. Never done unless asked."""


@dataclass
class ImageFolderConfig(LoaderConfig):
    _target_: str = "src.components.vision.image_folder"
    root: str = MISSING
    """Folder holding `train/<class>/<image>`, `val/<class>/<image>` and `test/<class>/<image>`
    (any format PIL reads); without test/, val/ is the test split too."""
    image_size: Any = None
    """[height, width] every image is resized to, or one size for squares (as torchvision's
    Resize takes it); None: the images must all be of one size. (`Any`: OmegaConf's schemas
    cannot say "an int or a list of ints"; the builder checks it.)"""
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    """Per-channel mean subtracted from the RGB images (in [0, 1]); ImageNet's by default."""
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    """Per-channel standard deviation the images are divided by."""


@dataclass
class TokensConfig(DataConfig):
    _target_: str = "src.components.data.tokens"
    path: str = MISSING
    """A token file (as nanoGPT's prepare scripts write `train.bin`), or a glob of them
    (`'shards/*.bin'`, llm.c's fineweb shards), read as one sequence in name order."""
    seq_len: int = 256
    vocab_size: int | None = None
    """None: the files' largest token + 1."""
    test_path: str | None = None
    """A token file (or glob) of its own for the test split; None: `test_fraction` of `path`."""
    dtype: TokenDtype = TokenDtype.uint16
    """The token ids of files without llm.c's shard header (a header names its own)."""


@dataclass
class TextConfig(DataConfig):
    _target_: str = "src.components.text.text"
    path: str = MISSING
    """A file, folder (with its subfolders) or glob of text files: .txt, .jsonl/.json (one
    document per record) and .parquet, each optionally .gz. The first run tokenizes them into
    `.token_cache/` beside them; later runs with the same files and tokenizer read that."""
    tokenizer: str = "gpt2"
    """char (each character a token), gpt2 (GPT-2's BPE through tiktoken, which downloads it;
    or any encoding tiktoken names), a .tiktoken file (GPT-2's kind, for machines without
    network: r50k_base.tiktoken is GPT-2's), a tokenizer.json (Hugging Face tokenizers) or a
    transformers tokenizer's folder. The run keeps it in `<run>/tokenizer/`."""
    text_field: str = "text"
    """The field (.jsonl/.json) or column (.parquet) that holds each document's text."""
    sample_by: SampleBy = SampleBy.document
    """What a document of a .txt file is: the whole file, each paragraph (split at blank
    lines), or each line. Documents are separated by the tokenizer's end-of-text token, and
    train, val and test get whole documents."""
    seq_len: int = 256
    """Input tokens per sample; the targets are the tokens that follow each one."""
    vocab_size: int | None = None
    """The model's vocabulary; None: the tokenizer's. Smaller than the tokenizer's is refused."""
    cache_dir: str | None = None
    """Where the token cache goes (a folder per set of files and tokenizer); None: a
    `.token_cache/` folder in the folder that holds the files."""
    num_proc: int | None = None
    """Processes that tokenize; None: one per core this process may use."""


@dataclass
class HFDatasetConfig(LoaderConfig):
    _target_: str = "src.components.streaming.hf_dataset"
    path: str = MISSING
    """A local file, folder or glob of .jsonl/.json, .parquet or .txt files (one record a line;
    files of one kind), or a data set on the Hugging Face hub (`HuggingFaceFW/fineweb`, with
    network). Streamed: read record by record, never downloaded or converted whole."""
    name: str | None = None
    """The hub data set's configuration (fineweb's `sample-10BT`); None: its default."""
    split: str = "train"
    """The hub data set's split to read (local files are one split)."""
    text_field: str = "text"
    """The field (column) that holds each record's text."""
    tokenizer: str = "gpt2"
    """As data=text's (char reads the whole set once for its characters: small local sets)."""
    seq_len: int = 256
    """Input tokens per sample; the targets are the tokens that follow each one."""
    vocab_size: int | None = None
    """The model's vocabulary; None: the tokenizer's. Smaller than the tokenizer's is refused."""
    val_documents: int = 100
    """The set's first records, held out to validate (tokenized once, kept in memory)."""
    test_documents: int = 100
    """The records after those, held out to test; 0: no test split (with trainer.test=false)."""
    streams: int = 8
    """Streams the training records are dealt into, round-robin, each packed on its own: the
    data-parallel processes must divide it (each reads its share of the streams), and what is
    trained depends on it, never on the processes."""


def data_builder_config(data: DictConfig) -> DictConfig:
    """The data settings without the loader's (`LoaderConfig`): what the builder takes."""
    loader_keys = {field.name for field in dataclasses.fields(LoaderConfig)}
    return OmegaConf.create({key: data[key] for key in data if key not in loader_keys})
