"""Text in: `data=text`'s first start (tokenizing about 50 MB of text into its token cache)
against tiktoken's own batched encoder on the same text and cores, and its second start (the
cache read): `tokenize`.

The text is made here, nothing is downloaded: documents of pseudo-words (Zipf-distributed, with
punctuation, numbers and paragraphs) in jsonl files. The BPE is GPT-2's where tiktoken has it
(its `gpt2`: from its download cache or the network), given to the template as a `.tiktoken`
file, the way a machine without network gives it; where tiktoken cannot get it, a stand-in of
GPT-2's size, a byte-level BPE trained by `tokenizers` on the text under GPT-2's pattern (the
output says which).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.workload import compose_config
from src.components.data import build_data
from src.components.tokenizer import read_tiktoken_bpe, write_tiktoken_bpe

CORES = 2
TEXT_MB = 50
FILES = 8
WORDS = 100_000  # the pseudo-vocabulary; a BPE of GPT-2's size learns most of it whole
GPT2_RANKS = 50_256  # GPT-2's BPE: 256 bytes and 50,000 merges; <|endoftext|> after them
BPE_TRAINING_MB = 20
SYLLABLES = "th e an re in on at er st ou al is or ed ng to it ha se le me wi ll be co de ve ro ly"
SYLLABLES += " ch sh ar ti ne ma po ra si un pe"
# Pieces between the words, each with its share of the text's pieces.
PUNCTUATION = {",": 0.05, ".": 0.04, ".\n\n": 0.01, "'s": 0.01, " 1": 0.01, " 2024": 0.01}
PUNCTUATION |= {" The": 0.01, " (": 0.005, ")": 0.005}


def write_text(folder: Path, megabytes: float = TEXT_MB, seed: int = 0) -> None:
    """About `megabytes` of documents (300 to 3,000 pieces each) in `FILES` jsonl files."""
    rng = np.random.default_rng(seed)
    syllables = np.array(SYLLABLES.split())
    words = [" " + "".join(rng.choice(syllables, size)) for size in rng.integers(1, 5, WORDS)]
    zipf = 1 / np.arange(1, WORDS + 1) ** 1.07
    shares = np.concatenate(
        [zipf / zipf.sum() * (1 - sum(PUNCTUATION.values())), [*PUNCTUATION.values()]]
    )
    pieces = np.array([*words, *PUNCTUATION], dtype=object)
    count = int(megabytes * 1e6 / 5.6)  # pieces of 5.6 characters on average
    drawn = pieces[rng.choice(len(pieces), count, p=shares / shares.sum())]
    ends = np.cumsum(rng.integers(300, 3000, count // 300))
    bounds = zip(np.r_[0, ends[ends < count]], np.r_[ends[ends < count], count], strict=True)
    documents = ["".join(drawn[first:end]) for first, end in bounds]
    for index, part in enumerate(np.array_split(np.arange(len(documents)), FILES)):
        lines = (json.dumps({"text": documents[i]}) + "\n" for i in part)
        (folder / f"part_{index}.jsonl").write_text("".join(lines))


def read_documents(folder: Path) -> list[str]:
    return [
        json.loads(line)["text"]
        for file in sorted(folder.glob("*.jsonl"))
        for line in file.read_text().splitlines()
    ]


def gpt2_bpe(folder: Path, path: Path) -> str:
    """Write GPT-2's BPE (or the stand-in) to `path`; say which."""
    import tiktoken

    try:
        write_tiktoken_bpe(tiktoken.get_encoding("gpt2")._mergeable_ranks, path)
        return "GPT-2's BPE (tiktoken's gpt2)"
    except OSError:  # no network, and not in tiktoken's cache: requests' ConnectionError is one
        ranks = trained_bpe(read_documents(folder))
        write_tiktoken_bpe(ranks, path)
        return (
            f"no GPT-2 BPE offline: a stand-in of {len(ranks):,} ranks trained by tokenizers on "
            f"{BPE_TRAINING_MB} MB of the text under GPT-2's pattern"
        )


def trained_bpe(documents: list[str]) -> dict[bytes, int]:
    """A byte-level BPE of up to GPT-2's size trained on the first `BPE_TRAINING_MB` of the
    documents, as tiktoken's ranks (a token's bytes: its id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=GPT2_RANKS, initial_alphabet=alphabet, show_progress=False
    )
    sizes = np.cumsum([len(document) for document in documents])
    training = documents[: int(np.searchsorted(sizes, BPE_TRAINING_MB * 1e6)) + 1]
    tokenizer.train_from_iterator(training, trainer)
    byte_of = {char: byte for byte, char in byte_level_chars().items()}
    return {bytes(byte_of[c] for c in token): i for token, i in tokenizer.get_vocab().items()}


def byte_level_chars() -> dict[int, str]:
    """GPT-2's stand-ins for bytes in its vocabulary's strings: printable ones as themselves,
    the others as the characters from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [byte for byte in range(256) if byte not in printable]
    return {byte: chr(byte) for byte in printable} | {
        byte: chr(256 + n) for n, byte in enumerate(others)
    }


@contextlib.contextmanager
def on_cores(count: int) -> Iterator[None]:
    """This process (and those it starts) on `count` of the cores it may use, for the block."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(allowed)[:count])
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


@dataclass
class Timed:
    """A side's wall time, the CPU time of its process and the processes it waited for, and
    the tokens it made."""

    seconds: float
    cpu_seconds: float
    tokens: int


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    """Wall and CPU seconds (this process's and its finished children's) of the block, in the
    list it gives, once the block ends. On a shared machine the CPU time is the steadier one."""

    def cpu() -> float:
        ours, children = (
            resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        return ours.ru_utime + ours.ru_stime + children.ru_utime + children.ru_stime

    took: list[float] = []
    wall, started = time.perf_counter(), cpu()
    yield took
    took += [time.perf_counter() - wall, cpu() - started]


def template_start(folder: Path, bpe: Path, cache: Path) -> Timed:
    """`data=text`'s data build on the folder (`CORES` tokenizing processes): from the files
    and the BPE's file to the token cache, and the splits read from it."""
    cfg = compose_config(
        "data=text",
        f"data.path={folder}",
        f"data.tokenizer={bpe}",
        f"data.cache_dir={cache}",
        f"data.num_proc={CORES}",
    )
    with timed() as took:
        data = build_data(cfg.data, cfg.seed)
    splits = [split for split in (data.train, data.val, data.test) if split is not None]
    return Timed(*took, sum(int(split.ranges[:, 2].sum()) for split in splits))


def tiktoken_encode(folder: Path, bpe: Path) -> Timed:
    """The same with tiktoken alone: the BPE's file read, the documents read, and
    `encode_ordinary_batch` on `CORES` threads; its tokens counted with an end-of-text token
    per document, as the cache holds them."""
    import tiktoken
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    with timed() as took:
        ranks = read_tiktoken_bpe(bpe)
        special = {ENDOFTEXT: len(ranks)}
        encoding = tiktoken.Encoding(
            "bpe", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special
        )
        tokens = encoding.encode_ordinary_batch(read_documents(folder), num_threads=CORES)
    return Timed(*took, sum(len(document) + 1 for document in tokens))


def tokenize_speed(rounds: int) -> None:
    """Median over rounds (alternating which side goes first) of each side's MB/s, tokens/s and
    CPU seconds, of their ratios (the template's speed / tiktoken's, by wall and by CPU time),
    and of the cached second start."""
    with tempfile.TemporaryDirectory() as scratch, on_cores(CORES):
        folder, bpe = Path(scratch) / "text", Path(scratch) / "gpt2.tiktoken"
        folder.mkdir()
        write_text(folder)
        megabytes = sum(file.stat().st_size for file in folder.iterdir()) / 1e6
        print(f"{'tokenize':<16}  {megabytes:.1f} MB of jsonl, {gpt2_bpe(folder, bpe)}")
        ours: list[Timed] = []
        theirs: list[Timed] = []
        second_starts = []
        for round_index in range(rounds):
            cache = Path(scratch) / f"cache_{round_index}"
            sides = [(ours, functools.partial(template_start, folder, bpe, cache))]
            sides.append((theirs, functools.partial(tiktoken_encode, folder, bpe)))
            for timings, side in sides if round_index % 2 == 0 else reversed(sides):
                timings.append(side())
            second_starts.append(template_start(folder, bpe, cache).seconds)
        tokens = ours[0].tokens
        assert all(side.tokens == tokens for side in ours + theirs), (ours, theirs)
        for label, timings in (("data=text", ours), (f"tiktoken x{CORES}", theirs)):
            seconds = statistics.median(side.seconds for side in timings)
            cpu_seconds = statistics.median(side.cpu_seconds for side in timings)
            print(
                f"{'':<16}  {label:<16}{megabytes / seconds:>7.1f} MB/s"
                f"{tokens / seconds / 1e6:>7.2f} M tokens/s{seconds:>7.2f} s"
                f"{cpu_seconds:>7.2f} CPU s"
            )
        for name in ("seconds", "cpu_seconds"):
            ratios = [
                getattr(b, name) / getattr(a, name) for a, b in zip(ours, theirs, strict=True)
            ]
            print(
                f"{'':<16}  ratio by {'wall' if name == 'seconds' else 'CPU'} time "
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
            )
        print(f"{'':<16}  second start (the cache read) {statistics.median(second_starts):.2f} s")
