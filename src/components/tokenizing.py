"""Documents into token ids over many processes: each document after the end-of-text token,
in chunks handed out to forked tokenizing processes as they free up, back in order."""

from __future__ import annotations

import collections
import multiprocessing
from collections.abc import Iterable, Iterator

import numpy as np

from src.components.tokenizer import Tokenizer

CHUNK_CHARS = 1 << 20  # text per task of a tokenizing process
READ_AHEAD = 4  # tasks per tokenizing process handed out before their results are read


def chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    """`texts` in lists of about `CHUNK_CHARS` characters (at least one text each)."""
    chunk, size = [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_tokenizer: Tokenizer | None = None  # a tokenizing process's, set as it starts


def keep_tokenizer(tokenizer: Tokenizer) -> None:
    global _tokenizer
    _tokenizer = tokenizer


def document_tokens(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """A document's tokens as the data holds them: the end-of-text token, then the text's."""
    return np.concatenate((np.array([tokenizer.eot], np.uint32), tokenizer.encode(text)))


def encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The texts' lengths in tokens and their tokens, each after the end-of-text token."""
    assert _tokenizer is not None
    documents = [document_tokens(_tokenizer, text) for text in texts]
    return np.array([len(document) for document in documents]), np.concatenate(documents)


def encoded(
    tokenizer: Tokenizer, texts: Iterable[str], processes: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`encode_chunk` of each chunk of `texts`, in order, over `processes` processes (forked:
    the tokenizer is theirs without pickling). Up to `READ_AHEAD` chunks per process are handed
    out ahead of the one awaited, a new one as each comes back: the processes never wait for
    each other, and memory holds no more of the text than that."""
    keep_tokenizer(tokenizer)
    pieces = chunks(texts)
    if processes == 1:
        yield from map(encode_chunk, pieces)
        return
    context = multiprocessing.get_context("fork")
    with context.Pool(processes, initializer=keep_tokenizer, initargs=(tokenizer,)) as pool:
        pending: collections.deque = collections.deque()
        for piece in pieces:
            pending.append(pool.apply_async(encode_chunk, (piece,)))
            if len(pending) > READ_AHEAD * processes:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
