"""The tokenizers of text data (`data.tokenizer`), behind one small interface, and their folder:
a run keeps its tokenizer in `<run>/tokenizer/` (`save`), and whatever reads the run later
(evaluation, sampling, export) gets it back with `load_tokenizer`; the export to the Hugging Face
format writes it as transformers reads it (`save_for_transformers`).

- `char`: each character one token, the vocabulary the characters the data holds (nanoGPT's
  shakespeare_char);
- `gpt2` (or another encoding tiktoken names): GPT-2's BPE through tiktoken, which downloads it
  at first use; a `.tiktoken` file (`r50k_base.tiktoken` is GPT-2's) for machines without
  network;
- a `tokenizer.json` file: Hugging Face `tokenizers`;
- a folder: a transformers tokenizer (`AutoTokenizer.from_pretrained`).

Documents are separated by the tokenizer's end-of-text token (`eot`). The libraries are optional:
each is imported when its kind is chosen, and a missing one is named in one line.
"""

from __future__ import annotations

import base64
import importlib
import json
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from src.config.base import first_line

KIND_FILE = "template_tokenizer.json"  # in a saved tokenizer's folder: which class reads it
# The end-of-text tokens a `tokenizer.json` may name, in the order they are looked for.
END_OF_TEXT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
# GPT-2's BPE as tiktoken's file, for machines where tiktoken cannot download `gpt2`'s.
GPT2_BPE_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"


def library(name: str, needed_by: str) -> Any:
    """The optional library `name`, or a one-line error naming it and what needs it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ValueError(f"{needed_by} needs {name}: pip install {name}") from None


class Tokenizer(ABC):
    """Text to token ids (0 .. vocab_size - 1) and back."""

    kind: ClassVar[str]
    vocab_size: int
    eot: int
    """The end-of-text token, which comes before each document."""

    @abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """`text`'s token ids, as uint32; special tokens' names in it are plain text."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def save_files(self, folder: Path) -> None: ...

    @classmethod
    @abstractmethod
    def load(cls, folder: Path) -> Tokenizer: ...

    def save(self, folder: Path) -> None:
        """Write the tokenizer into `folder`, for `load_tokenizer`."""
        folder.mkdir(parents=True, exist_ok=True)
        self.save_files(folder)
        (folder / KIND_FILE).write_text(json.dumps({"kind": self.kind}))


class CharTokenizer(Tokenizer):
    """Each character one token, in code point order; the end-of-text token after them."""

    kind = "char"
    EOT_TEXT = "<|endoftext|>"

    def __init__(self, chars: str):
        self.chars = chars
        self.vocab_size, self.eot = len(chars) + 1, len(chars)
        codes = np.frombuffer(chars.encode("utf-32-le"), np.uint32)
        self.ids = np.full(int(codes.max(initial=0)) + 1, -1, np.int64)  # by code point
        self.ids[codes] = np.arange(len(chars))

    @classmethod
    def of(cls, texts: Iterable[str]) -> CharTokenizer:
        """The characters of `texts`."""
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return cls("".join(sorted(chars)))

    def encode(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        known = codes < len(self.ids)
        ids = np.where(known, self.ids[np.where(known, codes, 0)], -1)
        if (ids < 0).any():
            unknown = sorted({chr(code) for code in codes[ids < 0]})
            raise ValueError(f"characters the char tokenizer does not know: {''.join(unknown)!r}")
        return ids.astype(np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.EOT_TEXT if i == self.eot else self.chars[i] for i in ids)

    def save_files(self, folder: Path) -> None:
        (folder / "chars.json").write_text(json.dumps(self.chars))

    @classmethod
    def load(cls, folder: Path) -> CharTokenizer:
        return cls(json.loads((folder / "chars.json").read_text()))


class TiktokenTokenizer(Tokenizer):
    """A tiktoken encoding (GPT-2's BPE, ...): its end-of-text token is `<|endoftext|>`."""

    kind = "tiktoken"
    BPE_FILE, SETTINGS_FILE = "bpe.tiktoken", "tiktoken.json"
    EOT = "<|endoftext|>"  # tiktoken's `eot_token` is this special token's

    def __init__(self, encoding: Any):
        self.encoding = encoding
        self.vocab_size, self.eot = encoding.n_vocab, encoding.eot_token

    @classmethod
    def named(cls, name: str) -> TiktokenTokenizer:
        """The encoding tiktoken calls `name`, downloaded at first use."""
        tiktoken = library("tiktoken", f"data.tokenizer={name}")
        if name not in tiktoken.list_encoding_names():
            raise ValueError(
                f"data.tokenizer={name}: no such tokenizer; give char, gpt2 (or another encoding "
                "tiktoken names), a .tiktoken file, a tokenizer.json or a transformers tokenizer's "
                "folder"
            )
        try:
            return cls(tiktoken.get_encoding(name))
        except OSError:  # requests' ConnectionError is one
            raise ValueError(
                f"data.tokenizer={name}: tiktoken could not download its BPE (no network?): "
                "give a local copy, data.tokenizer=/path/to/r50k_base.tiktoken "
                f"(GPT-2's, from {GPT2_BPE_URL}), or set TIKTOKEN_CACHE_DIR to a folder of "
                "tiktoken's cached files"
            ) from None

    @classmethod
    def of_file(cls, path: Path, chosen: str) -> TiktokenTokenizer:
        """A `.tiktoken` file of GPT-2's kind: its ranks under GPT-2's pattern, `<|endoftext|>`
        after them."""
        library("tiktoken", f"data.tokenizer={chosen}")
        from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

        ranks = read_tiktoken_bpe(path)
        settings = {"pat_str": r50k_pat_str, "special_tokens": {ENDOFTEXT: len(ranks)}}
        return cls.of_ranks(path.stem, ranks, settings)

    @classmethod
    def of_ranks(cls, name: str, ranks: dict[bytes, int], settings: dict) -> TiktokenTokenizer:
        import tiktoken

        return cls(tiktoken.Encoding(name, mergeable_ranks=ranks, **settings))

    def encode(self, text: str) -> np.ndarray:
        # Straight into an array, without a list of ints between (a tenth of the time); with no
        # special token allowed or refused, tiktoken's `encode` is its `encode_ordinary`.
        try:
            return self.encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates, which JSON strings may hold: mended here
            return np.asarray(self.encoding.encode_ordinary(text), np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))

    def save_files(self, folder: Path) -> None:
        encoding = self.encoding  # its fields that tiktoken's own pickling reads
        write_tiktoken_bpe(encoding._mergeable_ranks, folder / self.BPE_FILE)
        settings = {"pat_str": encoding._pat_str, "special_tokens": encoding._special_tokens}
        (folder / self.SETTINGS_FILE).write_text(json.dumps({"name": encoding.name, **settings}))

    @classmethod
    def load(cls, folder: Path) -> TiktokenTokenizer:
        ranks, settings = cls.read_files(folder)
        return cls.of_ranks(settings.pop("name"), ranks, settings)

    @classmethod
    def read_files(cls, folder: Path) -> tuple[dict[bytes, int], dict[str, Any]]:
        """The ranks and the settings (name, pat_str, special_tokens) `save_files` wrote."""
        settings = json.loads((folder / cls.SETTINGS_FILE).read_text())
        return read_tiktoken_bpe(folder / cls.BPE_FILE), settings

    @classmethod
    def save_for_transformers(cls, saved: Path, folder: Path) -> None:
        """The encoding `save` wrote into `saved` (tiktoken not needed), written into `folder` as
        a transformers tokenizer (`tiktoken_for_transformers`): tokenizer.json and its config."""
        library("transformers", f"the export of the tiktoken tokenizer in {saved}")
        from src.components.tiktoken_for_transformers import transformers_tokenizer

        ranks, settings = cls.read_files(saved)
        special_tokens = settings["special_tokens"]
        tokenizer = transformers_tokenizer(ranks, settings["pat_str"], special_tokens, cls.EOT)
        tokenizer.save_pretrained(str(folder))


# A `.tiktoken` file: a line per token, its bytes in base64 and its rank. Read and written here:
# tiktoken's `load_tiktoken_bpe` also copies a local file into its download cache, and its
# `dump_tiktoken_bpe` needs the blobfile package.
def read_tiktoken_bpe(path: Path) -> dict[bytes, int]:
    lines = (line.split() for line in path.read_text().splitlines() if line)
    return {base64.b64decode(token): int(rank) for token, rank in lines}


def write_tiktoken_bpe(ranks: dict[bytes, int], path: Path) -> None:
    in_order = sorted(ranks.items(), key=lambda item: item[1])
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in in_order)
    path.write_text("".join(lines))


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer (a `tokenizer.json`); its end-of-text token is the
    first of `END_OF_TEXT_NAMES` it has."""

    kind = "tokenizers"
    FILE = "tokenizer.json"

    def __init__(self, tokenizer: Any, chosen: str):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        vocabulary = tokenizer.get_vocab(with_added_tokens=True)
        names = [name for name in END_OF_TEXT_NAMES if name in vocabulary]
        if not names:
            raise ValueError(
                f"data.tokenizer={chosen} has no end-of-text token to separate documents by "
                f"(any of {', '.join(END_OF_TEXT_NAMES)}); add one as a special token"
            )
        self.eot = vocabulary[names[0]]

    @classmethod
    def of_file(cls, path: Path, chosen: str) -> HFTokenizer:
        tokenizers = library("tokenizers", f"data.tokenizer={chosen}")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises plain Exceptions
            raise ValueError(
                f"data.tokenizer={chosen}: tokenizers cannot load it: {first_line(error)}"
            ) from error
        return cls(tokenizer, chosen)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save_files(self, folder: Path) -> None:
        self.tokenizer.save(str(folder / self.FILE))

    @classmethod
    def load(cls, folder: Path) -> HFTokenizer:
        return cls.of_file(folder / cls.FILE, str(folder))


class TransformersTokenizer(Tokenizer):
    """A transformers tokenizer (`save_pretrained`'s folder); its end-of-text token is its
    `eos_token`."""

    kind = "transformers"

    def __init__(self, tokenizer: Any, chosen: str):
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"data.tokenizer={chosen} has no eos_token to separate documents by; set one in "
                "its tokenizer_config.json"
            )
        self.tokenizer = tokenizer
        self.vocab_size, self.eot = len(tokenizer), tokenizer.eos_token_id

    @classmethod
    def of_folder(cls, folder: Path, chosen: str) -> TransformersTokenizer:
        transformers = library("transformers", f"data.tokenizer={chosen}")
        transformers.logging.set_verbosity_error()  # its notes on sequences longer than a model's
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as error:
            raise ValueError(
                f"data.tokenizer={chosen}: transformers cannot load it: {first_line(error)}"
            ) from None
        return cls(tokenizer, chosen)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def save_files(self, folder: Path) -> None:
        self.tokenizer.save_pretrained(str(folder))

    @classmethod
    def load(cls, folder: Path) -> TransformersTokenizer:
        return cls.of_folder(folder, str(folder))


KINDS = {kind.kind: kind for kind in Tokenizer.__subclasses__()}


def build_tokenizer(chosen: str, texts: Iterable[str]) -> Tokenizer:
    """The tokenizer `data.tokenizer` names (`texts`, the data's, are read for `char` only)."""
    path = Path(chosen).expanduser()
    if chosen == "char":
        return CharTokenizer.of(texts)
    if path.is_dir():
        return TransformersTokenizer.of_folder(path, chosen)
    if path.is_file() and path.suffix == ".tiktoken":
        return TiktokenTokenizer.of_file(path, chosen)
    if path.is_file() and path.suffix == ".json":
        return HFTokenizer.of_file(path, chosen)
    if path.exists() or path.suffix or "/" in chosen:
        raise ValueError(
            f"data.tokenizer={chosen}: not a tokenizer; give char, gpt2, a .tiktoken file, a "
            "tokenizer.json or a transformers tokenizer's folder"
        )
    return TiktokenTokenizer.named(chosen)


def load_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer `Tokenizer.save` wrote into `folder` (a run's: `<run>/tokenizer/`)."""
    return KINDS[saved_kind(folder)].load(Path(folder))


def saved_kind(folder: Path) -> str:
    """The kind of the tokenizer `Tokenizer.save` wrote into `folder` (a `Tokenizer.kind`)."""
    return json.loads((Path(folder) / KIND_FILE).read_text())["kind"]


def save_for_transformers(saved: Path, folder: Path) -> None:
    """The tokenizer saved in `saved` (a run's), written into `folder` in files transformers'
    `AutoTokenizer` reads where its kind has them: a tiktoken encoding's converted, any other's
    as they are (a tokenizer.json and a transformers tokenizer are transformers' own)."""
    if saved_kind(saved) == TiktokenTokenizer.kind:
        TiktokenTokenizer.save_for_transformers(saved, folder)
    else:
        shutil.copytree(saved, folder, dirs_exist_ok=True)
