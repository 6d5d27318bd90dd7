"""A tiktoken encoding as a transformers tokenizer, for the export of a run to the Hugging Face
format (`tokenizer.save_for_transformers`): tiktoken's files are no format transformers reads.

The BPE is transformers' own conversion of tiktoken's (`TikTokenConverter`: a byte-level BPE whose
merges rank as tiktoken's ranks, the encoding's split pattern before it), given the ranks in
memory: its own reading of a `.tiktoken` file goes through tiktoken's download cache, which is
keyed by the path alone (a file changed at the same path would read as the old one). Imported only
where transformers is installed.
"""

from __future__ import annotations

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter


class RanksConverter(TikTokenConverter):
    """transformers' converter of tiktoken's BPE, from `ranks` (token bytes: id), with the
    special tokens at their tiktoken ids (the converter numbers them after the ranks, which is
    not where every encoding has them)."""

    def __init__(self, ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int]):
        super().__init__(pattern=pattern)
        self.ranks, self.special_tokens = ranks, special_tokens

    def load_tiktoken_bpe(self, vocab_file: str | None) -> dict[bytes, int]:
        return self.ranks

    def extract_vocab_merges_from_model(self, tiktoken_url: str | None) -> tuple:
        vocab, merges = super().extract_vocab_merges_from_model(tiktoken_url)
        return vocab | self.special_tokens, merges


def transformers_tokenizer(
    ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int], eot: str
) -> PreTrainedTokenizerFast:
    """The tiktoken encoding of `ranks`, `pattern` and `special_tokens` as a transformers
    tokenizer that gives its ids (its special tokens allowed, as GPT-2's own transformers
    tokenizer has `<|endoftext|>`) and decodes them to its text; `eot` is its beginning, end and
    unknown token, as GPT-2's is."""
    tokenizer = RanksConverter(ranks, pattern, special_tokens).converted()
    tokenizer.add_special_tokens(
        [AddedToken(name, normalized=False, special=True) for name in special_tokens]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=eot,
        eos_token=eot,
        unk_token=eot,
        clean_up_tokenization_spaces=False,  # decode as tiktoken does, spaces as they are
    )
