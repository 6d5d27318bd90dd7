"""A data set streamed through Hugging Face `datasets` (`data=hf_dataset`): read record by
record (`streaming=True`: nothing downloaded or converted up front), tokenized as it is read with
data=text's tokenizers, and packed into windows of `seq_len + 1` tokens.

`data.path` is a local file, folder or glob of `.jsonl`/`.json`, `.parquet` or `.txt` files (one
record a line), or a data set's name on the Hugging Face hub (with network). Its first
`val_documents` records validate and the next `test_documents` test (both tokenized once, held in
memory); the rest train, as a `TokenStream`.

The training records are dealt round-robin into `data.streams` streams (datasets'
`split_dataset_by_node`, one example in `streams` each), each packed on its own: each document
after the tokenizer's end-of-text token, windows running across documents, each starting
`seq_len` tokens after the one before (as `data=tokens`' do). Global window g comes from stream
g mod `streams`; rank r of W takes the windows r, r + W, ... of each global batch, so it reads
only the streams r, r + W, ... (W must divide `streams`), and the ranks' batches at a step are
the batch one process reads there. Where each stream is, [pass over the set, document, token
offset], is what a checkpoint keeps: a resumed run skips the records before it without
tokenizing them, and goes on with exactly the tokens the uninterrupted run read.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from src.components.data_contract import Batch, Data, Split, Stream, StreamReader
from src.components.text import check_vocabulary, text_files, text_suffix
from src.components.tokenizer import Tokenizer, build_tokenizer
from src.components.tokenizing import document_tokens
from src.config.base import first_line

# The `datasets` builder that reads each kind of local file.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def hf_dataset(
    seed: int,
    path: str,
    name: str | None,
    split: str,
    text_field: str,
    tokenizer: str,
    seq_len: int,
    vocab_size: int | None,
    val_documents: int,
    test_documents: int,
    streams: int,
) -> Data:
    """The records `path` names, streamed: the first `val_documents` validate, the next
    `test_documents` test (none at 0), the rest train as `streams` packed streams. The
    vocabulary is `vocab_size`, by default the tokenizer's."""
    del seed  # a stream is read in its own order
    if val_documents < 1 or test_documents < 0 or streams < 1:
        raise ValueError(
            f"data.val_documents={val_documents}, data.test_documents={test_documents} and "
            f"data.streams={streams}: give at least 1 validation document, 0 or more test "
            "documents and 1 or more streams"
        )
    records = Records(streamed(path, name, split), path, text_field)
    # char's vocabulary is the characters of the whole set: one pass, for small local sets.
    chosen = build_tokenizer(tokenizer, records.texts(records.dataset))
    check_vocabulary(chosen, tokenizer, vocab_size)
    held_out = records.dataset.take(val_documents + test_documents)
    val = packed_split(records, held_out.take(val_documents), chosen, seq_len, "val")
    test = None
    if test_documents:
        test = packed_split(records, held_out.skip(val_documents), chosen, seq_len, "test")
    train = TokenStream(records, val_documents + test_documents, chosen, seq_len, streams)
    vocabulary = chosen.vocab_size if vocab_size is None else vocab_size
    return Data(train, val, test, (seq_len,), vocabulary, tokenizer=chosen)


def datasets_library() -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError("data=hf_dataset needs datasets: pip install datasets") from None
    return datasets


def streamed(path: str, name: str | None, split: str) -> Any:
    """`path`'s records as a streaming `datasets.IterableDataset`: a local file, folder or glob
    (read by the builder of its files' kind), else a data set on the hub."""
    datasets = datasets_library()
    expanded = os.path.expanduser(path)
    if os.path.exists(expanded) or any(char in path for char in "*?["):
        files = text_files(path)
        kinds = {BUILDERS[text_suffix(file)] for file in files}
        if len(kinds) > 1:
            raise ValueError(
                f"data.path={path} holds files of several kinds ({', '.join(sorted(kinds))}); "
                "give files of one kind"
            )
        (builder,) = kinds
        data_files = [str(file) for file in files]
        return datasets.load_dataset(builder, data_files=data_files, split="train", streaming=True)
    if path.startswith(("/", ".", "~")) or Path(path).suffix:
        raise ValueError(
            f"data.path={path}: no such file or folder (a data set on the hub is named owner/name)"
        )
    try:
        return datasets.load_dataset(path, name=name, split=split, streaming=True)
    except Exception as error:  # noqa: BLE001 - the hub's errors share no other base
        reason = first_line(error)
        raise ValueError(f"data.path={path}: datasets cannot load it: {reason}") from None


class Records:
    """A streaming data set and where its records keep their text."""

    def __init__(self, dataset: Any, path: str, text_field: str):
        self.dataset, self.path, self.text_field = dataset, path, text_field

    def texts(self, records: Any) -> Iterator[str]:
        """The text of each of `records` (this set's, or a part of it)."""
        for record in records:
            text = record.get(self.text_field)
            if not isinstance(text, str):
                raise ValueError(
                    f"data.text_field={self.text_field}: a record of data.path={self.path} has "
                    f"no such text field (its fields: {', '.join(record)}); "
                    "name the field that holds the text"
                )
            yield text


def tokens_of(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """A document's tokens (`document_tokens`); none for a blank one, which data=text skips."""
    return document_tokens(tokenizer, text) if text.strip() else np.empty(0, np.uint32)


def packed_split(
    records: Records, part: Any, tokenizer: Tokenizer, seq_len: int, name: str
) -> Split:
    """The documents of `part`, packed into windows (as a stream's), in memory."""
    pieces = [tokens_of(tokenizer, text) for text in records.texts(part)]
    tokens = torch.from_numpy(np.concatenate([np.empty(0, np.uint32), *pieces]).astype(np.int64))
    if len(tokens) <= seq_len:
        raise ValueError(
            f"data.{name}_documents: the {name} documents of data.path={records.path} hold "
            f"{len(tokens)} tokens, too few for one window of data.seq_len={seq_len} + 1; raise "
            f"data.{name}_documents or lower data.seq_len"
        )
    windows = tokens.unfold(0, seq_len + 1, seq_len)
    return Split(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


START = [0, 0, 0]  # a stream's position before it is read: pass 0, document 0, token 0


class TokenStream(Stream):
    """The training records (those after the first `skipped`), dealt into `streams` streams
    and packed into windows of `seq_len + 1` tokens as they are read."""

    def __init__(
        self, records: Records, skipped: int, tokenizer: Tokenizer, seq_len: int, streams: int
    ):
        self.records, self.skipped, self.tokenizer = records, skipped, tokenizer
        self.seq_len, self.streams = seq_len, streams

    def check_shards(self, world_size: int) -> None:
        if self.streams % world_size:
            raise ValueError(
                f"data.streams={self.streams} cannot be shared by {world_size} data-parallel "
                f"processes: set data.streams to a multiple of {world_size} (what is trained "
                "depends on data.streams, never on the processes)"
            )

    def documents(self, stream: int, first: int) -> Iterator[str]:
        """The texts of stream `stream`'s documents from its `first` on."""
        from datasets.distributed import split_dataset_by_node

        # Skipped before it is dealt (datasets applies a skip after the deal before it too).
        rest = self.records.dataset.skip(self.skipped + first * self.streams)
        dealt = split_dataset_by_node(rest, stream, self.streams, strategy="examples")
        return self.records.texts(dealt)

    def batches(
        self,
        batch_size: int,
        rank: int,
        world_size: int,
        start_batch: int,
        position: dict[int, list[int]] | None,
    ) -> PackedBatches:
        self.check_shards(world_size)
        if position is None and start_batch:
            raise ValueError(
                "trainer.resume: the checkpoint holds no position of data=hf_dataset's stream; "
                "resume a run that read it, or start a new one"
            )
        if position is not None and set(position) != set(range(self.streams)):
            raise ValueError(
                f"trainer.resume: the checkpoint was read as {len(position)} streams, this run "
                f"as data.streams={self.streams}; resume with data.streams={len(position)}"
            )
        own = range(rank, self.streams, world_size)
        packers = {
            stream: Packer(self, stream, START if position is None else position[stream])
            for stream in own
        }
        # Rank r's n-th window is global window r + W n, from stream (r + W n) mod streams.
        local = batch_size // world_size
        order = itertools.islice(itertools.cycle(own), start_batch * local % len(own), None)
        return PackedBatches(packers, order, local)


class PackedBatches(StreamReader):
    """One rank's batches: each window from the next of its streams, in turn."""

    def __init__(self, packers: dict[int, Packer], order: Iterator[int], local: int):
        self.packers, self.order, self.local = packers, order, local

    def __next__(self) -> Batch:
        windows = [self.packers[next(self.order)].window() for _ in range(self.local)]
        tokens = torch.from_numpy(np.stack(windows).astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[int, list[int]]:
        return {stream: packer.position for stream, packer in self.packers.items()}


class Packer:
    """One stream's documents, tokenized as they are read, in windows of `seq_len + 1` tokens
    each `seq_len` after the one before; after the stream's last document, its first again (the
    next pass). `position` is where the next window starts: [pass, document, token offset]."""

    def __init__(self, stream: TokenStream, index: int, position: list[int]):
        self.stream, self.index = stream, index
        self.epoch, self.next_document, self.offset = position
        self.documents = stream.documents(index, self.next_document)
        self.pass_from = self.next_document  # where this pass's reading began
        self.read_tokens = 0  # in this pass
        # Documents read and not yet wholly windowed: (pass, document, tokens), none empty.
        self.pending: deque[tuple[int, int, np.ndarray]] = deque()

    @property
    def position(self) -> list[int]:
        epoch, document = self.pending[0][:2] if self.pending else (self.epoch, self.next_document)
        return [epoch, document, self.offset]

    def window(self) -> np.ndarray:
        size = self.stream.seq_len + 1
        while sum(len(tokens) for *_, tokens in self.pending) - self.offset < size:
            self.read()
        pieces, start, needed = [], self.offset, size
        for *_, tokens in self.pending:
            piece = tokens[start : start + needed]
            pieces.append(piece)
            start, needed = 0, needed - len(piece)
            if not needed:
                break
        self.offset += self.stream.seq_len
        while self.offset >= len(self.pending[0][2]):  # a token of the next window stays
            self.offset -= len(self.pending.popleft()[2])
        return np.concatenate(pieces)

    def read(self) -> None:
        """Read on to the next document with text, into the next pass at the stream's end."""
        while True:
            text = next(self.documents, None)
            if text is None:
                if self.pass_from == 0 and self.read_tokens == 0:
                    raise ValueError(
                        f"data.streams={self.stream.streams}: stream {self.index} of data.path="
                        f"{self.stream.records.path} holds no text; lower data.streams or give "
                        "more documents"
                    )
                self.next_pass()
                continue
            document, self.next_document = self.next_document, self.next_document + 1
            tokens = tokens_of(self.stream.tokenizer, text)
            if len(tokens):
                self.read_tokens += len(tokens)
                self.pending.append((self.epoch, document, tokens))
                return

    def next_pass(self) -> None:
        self.epoch, self.next_document = self.epoch + 1, 0
        self.pass_from, self.read_tokens = 0, 0
        self.documents = self.stream.documents(self.index, 0)
