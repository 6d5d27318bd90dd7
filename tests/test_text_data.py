"""Your own text (`data=text`) and many token files (`data=tokens`): every format reads the same
documents, every tokenizer kind that works offline tokenizes them and comes back from its folder,
the token cache is written once and reused, and a GPT trains on text under ddp as under single,
its tokenizer kept in the run folder. Every text is written by the test: nothing is downloaded."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from helpers import SGD, TINY, assert_same_training, reference_run, run_train

import src.components.tokenizing as tokenizing
from src.components.data import tokens
from src.components.text import CACHE_FOLDER, cached_tokens, text
from src.components.token_files import TokenWindows, stream_ranges, token_files, write_shard
from src.components.tokenizer import load_tokenizer, write_tiktoken_bpe
from src.runtime.run_folder import tokenizer_dir

DOCUMENTS = [
    f"Document {i}: the cat sat on the mat, and then {i * 7} more words." for i in range(20)
]


def read(path: Path, tokenizer: str = "char", **settings) -> tuple:
    """`data=text` on `path` (2 tokenizing processes unless `settings` say), and its cache's
    documents' tokens, in document order."""
    chosen = {"text_field": "text", "sample_by": "document", "seq_len": 8, "vocab_size": None}
    chosen |= {"val_fraction": 0.1, "test_fraction": 0.1, "cache_dir": None, "num_proc": 2}
    data = text(0, str(path), tokenizer, **(chosen | settings))
    folder = next(p for p in cache_root(path).iterdir() if p.is_dir() and "." not in p.name)
    shards, documents = cached_tokens(folder)
    stream = np.concatenate([shard.tokens() for shard in shards])
    return data, [stream[first : first + count] for _, first, count in documents]


def cache_root(path: Path) -> Path:
    return (path if path.is_dir() else path.parent) / CACHE_FOLDER


def write_jsonl(path: Path, documents: list[str]) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as file:
        file.writelines(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(documents))


def write_parquet(path: Path, documents: list[str]) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    table = pyarrow.table({"text": documents})
    if path.suffix == ".gz":
        parquet.write_table(table, path.with_suffix(""))
        path.write_bytes(gzip.compress(path.with_suffix("").read_bytes()))
        path.with_suffix("").unlink()
    else:
        parquet.write_table(table, path)


FORMATS = {
    "txt folder": lambda folder: [
        (folder / f"{i:02d}.txt").write_text(d) for i, d in enumerate(DOCUMENTS)
    ],
    "jsonl": lambda folder: write_jsonl(folder / "all.jsonl", DOCUMENTS),
    "jsonl.gz": lambda folder: write_jsonl(folder / "all.jsonl.gz", DOCUMENTS),
    "json list": lambda folder: (folder / "all.json").write_text(
        json.dumps([{"text": d} for d in DOCUMENTS])
    ),
    "parquet": lambda folder: write_parquet(folder / "all.parquet", DOCUMENTS),
    "parquet.gz": lambda folder: write_parquet(folder / "all.parquet.gz", DOCUMENTS),
}


def test_every_format_reads_the_same_documents_split_by_document(tmp_path, monkeypatch):
    """Each format (and 1 or 2 tokenizing processes) gives the same documents, each after the
    end-of-text token; train, val and test are whole documents, chosen from the seed. Chunks of
    two documents: more than the processes are handed at once, which come back in order."""
    monkeypatch.setattr(tokenizing, "CHUNK_CHARS", 2 * len(DOCUMENTS[0]))
    read_documents = {}
    for name, write in FORMATS.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        write(folder)
        data, documents = read(folder, num_proc=1 if name == "jsonl" else 2)
        tokenizer = data.tokenizer
        read_documents[name] = [tokenizer.decode(document[1:]) for document in documents]
        assert all(document[0] == tokenizer.eot for document in documents)
    assert all(documents == DOCUMENTS for documents in read_documents.values()), read_documents
    splits = [data.train, data.val, data.test]
    assert all(isinstance(split, TokenWindows) for split in splits)
    # The splits are runs of whole documents, and together every token once.
    starts = {(0, sum(len(d) for d in documents[:i])) for i in range(len(documents))}
    assert all((file, first) in starts for split in splits for file, first, _ in split.ranges)
    assert sum(int(split.ranges[:, 2].sum()) for split in splits) == sum(map(len, documents))
    other_seed = text(1, str(folder), "char", "text", "document", 8, None, 0.1, 0.1, None, 1)
    assert not np.array_equal(other_seed.val.ranges, data.val.ranges)
    assert data.num_classes == len(set("".join(DOCUMENTS))) + 1


def bpe_tokenizer(path: Path):
    """A byte-level BPE trained by `tokenizers` on DOCUMENTS, with GPT-2's end-of-text token."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet
    )
    tokenizer.train_from_iterator(DOCUMENTS, trainer)
    tokenizer.save(str(path))
    return tokenizer


def tiktoken_file(path: Path) -> Path:
    """A small GPT-2-kind BPE as tiktoken's file: every byte, and a few merges."""
    pytest.importorskip("tiktoken")
    merged = [b"th", b"he", b"the", b" t", b" the", b"at", b" m", b"or"]
    ranks = {bytes([byte]): byte for byte in range(256)}
    ranks |= {token: 256 + rank for rank, token in enumerate(merged)}
    write_tiktoken_bpe(ranks, path)
    return path


def tokenizer_json(path: Path) -> Path:
    bpe_tokenizer(path)
    return path


def transformers_folder(folder: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    tokenizer = bpe_tokenizer(folder.parent / "for-transformers.json")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>"
    )
    fast.save_pretrained(str(folder))
    return folder


TOKENIZERS = {
    "char": lambda tmp: "char",
    "tiktoken file": lambda tmp: str(tiktoken_file(tmp / "small.tiktoken")),
    "tokenizer.json": lambda tmp: str(tokenizer_json(tmp / "tokenizer.json")),
    "transformers folder": lambda tmp: str(transformers_folder(tmp / "hf-tokenizer")),
}


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_every_tokenizer_kind_tokenizes_and_comes_back_from_its_folder(tmp_path, kind):
    chosen = TOKENIZERS[kind](tmp_path)
    data_file = tmp_path / "data" / "all.jsonl"
    data_file.parent.mkdir()
    write_jsonl(data_file, DOCUMENTS)
    data, documents = read(data_file, chosen)
    tokenizer = data.tokenizer
    assert [tokenizer.decode(document[1:]) for document in documents] == DOCUMENTS
    assert data.num_classes == tokenizer.vocab_size
    tokenizer.save(tmp_path / "saved")
    loaded = load_tokenizer(tmp_path / "saved")
    assert (loaded.vocab_size, loaded.eot) == (tokenizer.vocab_size, tokenizer.eot)
    assert np.array_equal(loaded.encode(DOCUMENTS[3]), tokenizer.encode(DOCUMENTS[3]))


def test_the_cache_is_written_once_and_reused(tmp_path, caplog):
    (tmp_path / "a.txt").write_text("\n\n".join(DOCUMENTS))
    caplog.set_level(logging.INFO, "src.components.text")
    first, documents = read(tmp_path / "a.txt", sample_by="paragraph")
    assert "tokenizing 1 file(s)" in caplog.text and len(documents) == len(DOCUMENTS)
    caplog.clear()
    second, _ = read(tmp_path / "a.txt", sample_by="paragraph")
    assert "tokenizing" not in caplog.text
    assert second.tokenizer.vocab_size == first.tokenizer.vocab_size
    assert np.array_equal(second.train.ranges, first.train.ranges)
    read(tmp_path / "a.txt", sample_by="line")  # another way to read documents: a cache of its own
    assert "tokenizing 1 file(s)" in caplog.text


def test_a_vocabulary_over_uint16_is_cached_as_uint32(tmp_path):
    characters = "".join(chr(code) for code in range(0x4E00, 0x4E00 + 70_000) if code < 0xD800)
    characters += "".join(chr(code) for code in range(0xE000, 0xE000 + 70_000 - len(characters)))
    lines = [characters[i : i + 7000] for i in range(0, len(characters), 7000)]
    (tmp_path / "wide.txt").write_text("\n".join(lines))
    data, documents = read(tmp_path / "wide.txt", sample_by="line")
    assert data.num_classes == 70_001 and documents[0].dtype == np.uint32
    assert [data.tokenizer.decode(document[1:]) for document in documents] == lines


def test_token_shards_read_across_files_with_or_without_header(tmp_path):
    """A glob of uint32 shards with llm.c's header and flat uint16 files is one sequence."""
    stream = np.random.default_rng(0).integers(0, 70_000, 3000)
    folder = tmp_path / "shards"
    folder.mkdir()
    write_shard(folder / "a_000.bin", stream[:1000].astype(np.uint32))
    write_shard(folder / "a_001.bin", stream[1000:2000].astype(np.uint32))
    (folder / "b_002.bin").write_bytes(stream[2000:].astype(np.uint16).tobytes())
    stream[2000:] = stream[2000:].astype(np.uint16)
    files = token_files("path", str(folder / "*.bin"), "uint16")
    assert [file.dtype for file in files] == [np.uint32, np.uint32, np.uint16]
    data = tokens(0, str(folder / "*.bin"), 8, None, 0.1, 0.1, None)
    assert data.num_classes == int(stream.max()) + 1
    assert len(data.train) == (2400 - 1) // 8
    for index in (0, 124, 125, 200):  # 124-125: across the first two files
        inputs, targets = data.train[index]
        assert inputs.tolist() == stream[index * 8 : index * 8 + 8].tolist()
        assert targets.tolist() == stream[index * 8 + 1 : index * 8 + 9].tolist()
    assert data.val[0][0].tolist() == stream[2700:2708].tolist()
    flat = stream_ranges(files, 0, 3000)
    assert flat.tolist() == [[0, 0, 1000], [1, 0, 1000], [2, 0, 1000]]
    with pytest.raises(FileNotFoundError, match="matches no token file"):
        token_files("path", str(folder / "*.nosuch"), "uint16")


@pytest.mark.equivalence
def test_a_gpt_trains_on_text_under_ddp_as_under_single(tmp_path):
    """`python train.py model=gpt data=text ... parallel=ddp parallel.devices=2`: the launcher
    tokenizes once (its ranks read its cache), the run keeps the tokenizer, and a later single
    run reads the cache and trains the same weights."""
    folder = tmp_path / "text"
    folder.mkdir()
    for i, document in enumerate(DOCUMENTS * 3):
        (folder / f"{i:02d}.txt").write_text(document * 2)
    run = (
        *(override for override in TINY if not override.startswith(("data.", "model."))),
        *SGD,
        *("model=gpt", "model.n_layer=2", "model.n_head=2", "model.n_embd=32"),
        *("data=text", f"data.path={folder}", "data.tokenizer=char", "data.seq_len=8"),
    )
    ddp = tmp_path / "ddp"
    result = run_train(*run, "parallel=ddp", "parallel.devices=2", run_dir=ddp)
    assert (result.stdout + result.stderr).count("tokenizing 60 file(s)") == 1
    tokenizer = load_tokenizer(tokenizer_dir(ddp))
    assert tokenizer.kind == "char" and tokenizer.decode(tokenizer.encode("the cat")) == "the cat"
    single = reference_run(*run)
    assert "tokenizing" not in (single / "train.log").read_text()
    assert_same_training(single, ddp)
