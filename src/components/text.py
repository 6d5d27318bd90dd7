"""Text as training data (`data=text`): files of text, tokenized once into a cache of token
shards beside them, read as windows of tokens.

`data.path` is a file, folder or glob of `.txt`, `.jsonl`/`.json` (each record's `text_field`)
and `.parquet` files, each optionally `.gz`. Each record is a document, and so is each `.txt`
file (or each of its paragraphs or lines: `sample_by`). The first run tokenizes the documents in
parallel over the cores, each after the tokenizer's end-of-text token, into llm.c's shard format
(`src/components/token_files.py`) in `.token_cache/<key>/` beside the files, the key a hash of
the files (paths, sizes, times) and the tokenizer; later runs read that cache. Whoever builds
the data first (the launcher, before any rank starts) tokenizes, under a file lock, so that ranks
started together (by torchrun) wait for it and never tokenize twice. Train, val and test are
whole documents, chosen from the seed.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import gzip
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from src.components.data import check_fraction, check_test_fraction
from src.components.data_contract import Data
from src.components.token_files import (
    TokenFile,
    TokenWindows,
    merged_ranges,
    read_token_file,
    token_dtype,
    write_shard,
)
from src.components.tokenizer import Tokenizer, build_tokenizer, load_tokenizer
from src.components.tokenizing import encoded
from src.runtime.progress import PhaseProgress, size_text

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
CACHE_FOLDER = ".token_cache"
CACHE_FORMAT = 1  # raised when what a cache holds changes, so that older caches are not read
META, DOCUMENTS, TOKENIZER = "meta.json", "documents.npy", "tokenizer"
SHARD_TOKENS = 100_000_000  # per shard, as llm.c's fineweb shards


def text(
    seed: int,
    path: str,
    tokenizer: str,
    text_field: str,
    sample_by: str,
    seq_len: int,
    vocab_size: int | None,
    val_fraction: float,
    test_fraction: float,
    cache_dir: str | None,
    num_proc: int | None,
) -> Data:
    """The documents of the text files `path` names, tokenized by `tokenizer` (through the
    cache), split by document from the seed: `val_fraction` of them validate, `test_fraction`
    test (none at 0), the rest train. The vocabulary is `vocab_size`, by default the
    tokenizer's."""
    check_fraction("val_fraction", val_fraction)
    check_test_fraction(test_fraction)
    files = text_files(path)
    source = TextSource(files, text_field, str(sample_by))
    folder = cache_folder(files, cache_dir) / cache_key(source, tokenizer)
    processes = num_proc or len(os.sched_getaffinity(0))
    chosen = tokenized(source, tokenizer, folder, processes, vocab_size)
    shards, documents = cached_tokens(folder)
    splits = document_splits(len(documents), val_fraction, test_fraction, seed, path)
    train, val, test = (
        None if split is None else TokenWindows(shards, merged_ranges(documents[split]), seq_len)
        for split in splits
    )
    for name, windows in (("validation", val), ("test", test)):
        if windows is not None and len(windows) == 0:
            raise ValueError(
                f"data.path={path}: its {name} documents hold too few tokens for one window of "
                f"data.seq_len={seq_len} + 1; lower data.seq_len or raise data.{name[:3]}_fraction"
            )
    vocabulary = chosen.vocab_size if vocab_size is None else vocab_size
    return Data(train, val, test, (seq_len,), vocabulary, tokenizer=chosen)


def text_files(path: str) -> list[Path]:
    """The text files `data.path` names (a file, a folder and its subfolders, or a glob), in
    name order; hidden files and folders (the token cache) are left out."""
    expanded = os.path.expanduser(path)
    if os.path.isfile(expanded):
        found = [Path(expanded)]
    else:
        pattern = os.path.join(expanded, "**", "*") if os.path.isdir(expanded) else expanded
        found = sorted(Path(name) for name in glob.glob(pattern, recursive=True))
    files = [file for file in found if file.is_file() and text_suffix(file) in TEXT_SUFFIXES]
    if not files:
        raise FileNotFoundError(
            f"data.path={path} holds no text files ({', '.join(TEXT_SUFFIXES)}, each optionally "
            ".gz)"
        )
    return files


def text_suffix(file: Path) -> str:
    """The suffix that says how to read `file`: the one before `.gz` for a gzipped one."""
    return Path(file.stem).suffix if file.suffix == ".gz" else file.suffix


class TextSource:
    """The documents of text files, in order."""

    def __init__(self, files: list[Path], text_field: str, sample_by: str):
        self.files, self.text_field, self.sample_by = files, text_field, sample_by

    def __iter__(self) -> Iterator[str]:
        self.bytes_read = 0  # about how far the files have been read, for progress
        for file in self.files:
            read_before, size = self.bytes_read, file.stat().st_size
            counted_within = text_suffix(file) != ".parquet" and file.suffix != ".gz"
            for document in self.file_documents(file):
                if counted_within:  # a character for a byte: near enough for an ETA
                    self.bytes_read = min(read_before + size, self.bytes_read + len(document))
                if document.strip():
                    yield document
            self.bytes_read = read_before + size

    def file_documents(self, file: Path) -> Iterator[str]:
        suffix = text_suffix(file)
        if suffix == ".parquet":
            yield from self.parquet_documents(file)
            return
        with opened(file) as stream:
            if suffix == ".txt":
                yield from self.txt_documents(stream.read())
            elif suffix == ".json" and stream.read(1024).lstrip().startswith("["):
                stream.seek(0)
                for number, record in enumerate(json.load(stream), 1):
                    yield self.record_text(record, file, f"record {number}")
            else:
                stream.seek(0)
                for number, line in enumerate(stream, 1):
                    if line.strip():
                        yield self.record_text(json.loads(line), file, f"line {number}")

    def txt_documents(self, content: str) -> list[str]:
        if self.sample_by == "paragraph":
            return re.split(r"\n\s*\n", content)
        return content.splitlines() if self.sample_by == "line" else [content]

    def record_text(self, record: Any, file: Path, where: str) -> str:
        if not isinstance(record, dict) or not isinstance(record.get(self.text_field), str):
            fields = ", ".join(record) if isinstance(record, dict) else "none: not an object"
            raise ValueError(
                f"data.text_field={self.text_field}: {file} {where} has no such text field (its "
                f"fields: {fields}); name the field that holds the text"
            )
        return record[self.text_field]

    def parquet_documents(self, file: Path) -> Iterator[str]:
        try:
            import pyarrow.parquet as parquet
        except ImportError:
            raise ValueError(
                f"data.path={file}: .parquet needs pyarrow: pip install pyarrow"
            ) from None
        # A parquet reader seeks: a gzipped file is decompressed whole first.
        whole = io.BytesIO(gzip.decompress(file.read_bytes())) if file.suffix == ".gz" else None
        table = parquet.ParquetFile(whole or file)
        columns = table.schema_arrow.names
        if self.text_field not in columns:
            raise ValueError(
                f"data.text_field={self.text_field}: {file} has no such column (its columns: "
                f"{', '.join(columns)}); name the column that holds the text"
            )
        for batch in table.iter_batches(columns=[self.text_field]):
            yield from batch.column(0).to_pylist()


def opened(file: Path) -> IO[str]:
    """`file` opened for reading text, through gzip when it is a `.gz`."""
    if file.suffix == ".gz":
        return gzip.open(file, "rt", encoding="utf-8")
    return file.open(encoding="utf-8")


def cache_folder(files: list[Path], cache_dir: str | None) -> Path:
    """`cache_dir`, or `.token_cache/` in the folder that holds the files."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.path.commonpath([file.resolve().parent for file in files])) / CACHE_FOLDER


def cache_key(source: TextSource, tokenizer: str) -> str:
    """A hash of what the tokens depend on: the files (paths, sizes and times), the tokenizer
    (its files', where it is read from files) and how documents are read."""
    described = {
        "format": CACHE_FORMAT,
        "files": [stamp(file) for file in source.files],
        "tokenizer": tokenizer_stamp(tokenizer),
        "text_field": source.text_field,
        "sample_by": source.sample_by,
    }
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def stamp(file: Path) -> list:
    status = file.stat()
    return [str(file.resolve()), status.st_size, status.st_mtime_ns]


def tokenizer_stamp(tokenizer: str) -> Any:
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return sorted(stamp(file) for file in path.iterdir() if file.is_file())
    return stamp(path) if path.is_file() else tokenizer


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (made if missing): one process at a time."""
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def tokenized(
    source: TextSource, chosen: str, folder: Path, processes: int, vocab_size: int | None
) -> Tokenizer:
    """The tokenizer, and the source's tokens in the cache `folder`: written there now unless a
    run wrote them before. A vocabulary larger than `vocab_size` (the model's) is refused before
    any tokenizing."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with locked(folder.parent / f"{folder.name}.lock"):
        cached = (folder / META).is_file()
        if cached:
            tokenizer = load_tokenizer(folder / TOKENIZER)
        else:
            tokenizer = build_tokenizer(chosen, source)
        check_vocabulary(tokenizer, chosen, vocab_size)
        if not cached:
            write_cache(source, tokenizer, folder, processes)
    return tokenizer


def check_vocabulary(tokenizer: Tokenizer, chosen: str, vocab_size: int | None) -> None:
    """The tokenizer's tokens fit `vocab_size` (the model's vocabulary; None: the tokenizer's)."""
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"data.tokenizer={chosen} has {tokenizer.vocab_size} tokens, more than "
            f"data.vocab_size={vocab_size} (the model's vocabulary); raise data.vocab_size "
            "or leave it unset (the tokenizer's)"
        )


def write_cache(source: TextSource, tokenizer: Tokenizer, folder: Path, processes: int) -> None:
    """Tokenize the source's documents into shards in `folder`, written whole or not at all (in
    a folder of its own, renamed when done)."""
    building = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
    try:
        tokenizer.save(building / TOKENIZER)
        shards = ShardWriter(building, token_dtype(tokenizer.vocab_size))
        progress = Progress(source, processes, tokenizer.kind)
        for lengths, tokens in encoded(tokenizer, source, processes):
            shards.add(lengths, tokens)
            progress.done(len(lengths), len(tokens))
        shards.close()
        meta = {"shards": shards.names, "documents": len(shards.documents), "tokens": shards.total}
        (building / META).write_text(json.dumps(meta))
        building.rename(folder)
        progress.finish(folder)
    finally:
        shutil.rmtree(building, ignore_errors=True)


def cached_tokens(folder: Path) -> tuple[list[TokenFile], np.ndarray]:
    """The cache's shards, and its documents (rows: shard index, first token, token count)."""
    meta = json.loads((folder / META).read_text())
    shards = [read_token_file(folder / name, "uint16") for name in meta["shards"]]
    return shards, np.load(folder / DOCUMENTS)


class ShardWriter:
    """Documents' tokens into shards of up to `SHARD_TOKENS` (a longer document alone in one),
    no document across two, and where each document is (`documents.npy`)."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.names: list[str] = []
        self.documents: list[tuple[int, int, int]] = []
        self.pending: list[np.ndarray] = []
        self.filled = self.total = 0

    def add(self, lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Documents of `lengths` tokens, one after the other in `tokens`."""
        for document in np.split(tokens, np.cumsum(lengths)[:-1]):
            if self.filled and self.filled + len(document) > self.shard_tokens:
                self.flush()
            self.documents.append((len(self.names), self.filled, len(document)))
            self.pending.append(document.astype(self.dtype))
            self.filled += len(document)
            self.total += len(document)

    def flush(self) -> None:
        name = f"tokens_{len(self.names):06d}.bin"
        write_shard(self.folder / name, np.concatenate(self.pending))
        self.names.append(name)
        self.pending, self.filled = [], 0

    def close(self) -> None:
        if self.pending:
            self.flush()
        np.save(self.folder / DOCUMENTS, np.array(self.documents, np.int64).reshape(-1, 3))


class Progress:
    """Says what tokenizing reads, how far it has got when it runs long (in bytes of the files
    read, `src/runtime/progress.py`), and what it wrote."""

    def __init__(self, source: TextSource, processes: int, kind: str):
        size = sum(file.stat().st_size for file in source.files)
        log.info(
            "tokenizing %d file(s) (%.1f MB) with the %s tokenizer on %d process(es)",
            len(source.files),
            size / 1e6,
            kind,
            processes,
        )
        self.source = source
        self.bar = PhaseProgress("tokenizing", size, size_text)
        self.documents = self.tokens = 0

    def done(self, documents: int, tokens: int) -> None:
        self.documents, self.tokens = self.documents + documents, self.tokens + tokens
        self.bar.advance_to(self.source.bytes_read)

    def finish(self, folder: Path) -> None:
        self.bar.finish()
        log.info("tokenized %d documents into %d tokens: %s", self.documents, self.tokens, folder)


def document_splits(
    count: int, val_fraction: float, test_fraction: float, seed: int, path: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The indices of the train, val and test documents (in order; test None at a
    `test_fraction` of 0): at least one each, chosen from the seed."""
    num_val = max(1, int(count * val_fraction))
    num_test = max(1, int(count * test_fraction)) if test_fraction else 0
    if count - num_val - num_test < 1:
        raise ValueError(
            f"data.path={path} holds {count} document(s), too few to split by document into "
            "train, val and test: give more, or set data.sample_by=paragraph (or line) to split "
            ".txt files into documents"
        )
    order = np.random.default_rng(seed).permutation(count)
    val, test, train = np.split(order, [num_val, num_val + num_test])
    return np.sort(train), np.sort(val), np.sort(test) if test_fraction else None
