"""Models as ordered stacks of blocks.

Every model is an `nn.Sequential`: a strategy may run it whole, replicate it, or cut the block list
into stages, and the state_dict keys (`0.weight`, `1.0.weight`, ...) stay the same either way.
Nothing here knows about devices or parallelism. The models have no BatchNorm, and dropout only
where a config asks for it (`model.dropout`, off by default), so that every strategy computes
exactly the same function as `single` (per-replica batch statistics, and masks drawn from each
process's own random stream, differ by design: docs/strategies.md#dropout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from src.components import gpt2_format


def _mlp_block(width_in: int, width_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width_in, width_out), nn.ReLU())


class MLP(nn.Sequential):
    """Flatten, `depth` hidden Linear+ReLU blocks, then a linear classifier head."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int, depth: int):
        if depth < 1:
            raise ValueError(f"model.depth must be at least 1, got {depth}")
        widths = [math.prod(input_shape)] + [hidden] * depth
        blocks = [_mlp_block(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True)]
        blocks[0].insert(0, nn.Flatten())
        super().__init__(*blocks, nn.Linear(hidden, num_classes))


class ConvNet(nn.Sequential):
    """`depth` conv blocks (3x3 conv, GroupNorm, ReLU, 2x2 pool after the first two), then a
    Flatten+MLP head. Expects (batch, channels, height, width) input."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, width: int, depth: int, hidden: int
    ):
        if len(input_shape) != 3:
            raise ValueError(
                f"model=convnet needs image-shaped input (channels, height, width), got "
                f"{list(input_shape)}; use data=mnist or set data.image_shape=[1,16,16]"
            )
        channels, height, width_px = input_shape
        blocks: list[nn.Module] = []
        for i in range(depth):
            layers = [
                nn.Conv2d(channels if i == 0 else width, width, 3, padding=1),
                nn.GroupNorm(1, width),
                nn.ReLU(),
            ]
            if i < 2:
                layers.append(nn.MaxPool2d(2))
                height, width_px = height // 2, width_px // 2
            blocks.append(nn.Sequential(*layers))
        head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(width * height * width_px, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )
        super().__init__(*blocks, head)


class FCN(nn.Sequential):
    """A small fully convolutional segmentation net: `depth` blocks of 3x3 conv, GroupNorm and
    ReLU at full resolution, then a 1x1 conv to per-pixel class logits. Input (batch, channels,
    height, width); output (batch, classes, height, width)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int, depth: int):
        if len(input_shape) != 3:
            raise ValueError(
                f"model=fcn needs image-shaped input (channels, height, width), got "
                f"{list(input_shape)}; use data=synthetic_segmentation"
            )
        widths = [input_shape[0]] + [hidden] * depth
        blocks = [
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.GroupNorm(1, b), nn.ReLU())
            for a, b in zip(widths[:-1], widths[1:], strict=True)
        ]
        super().__init__(*blocks, nn.Conv2d(hidden, num_classes, 1))


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.token = nn.Embedding(vocab_size, hidden)
        self.position = nn.Embedding(seq_len, hidden)
        self.dropout = nn.Dropout(dropout)
        # Each token's place in its sequence, kept (not saved) rather than made in `forward`: a
        # strategy that gives a process some of a sequence's tokens gives it their places too.
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """`start`: the place of the first token (generation's, after the tokens it cached)."""
        places = self.positions[start : start + tokens.shape[1]]
        return self.dropout(self.token(tokens) + self.position(places))


class KeyValueCache:
    """One attention layer's keys and values of the tokens a generation has seen so far, in room
    for `capacity` tokens (the model's positions): each new token attends to them instead of
    computing them again. Generation only: training never passes one."""

    def __init__(self, batch: int, heads: int, capacity: int, head_width: int, like: torch.Tensor):
        shape = (batch, heads, capacity, head_width)
        self.keys = like.new_empty(shape)
        self.values = like.new_empty(shape)
        self.length = 0

    def extended(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The cached keys and values followed by these (batch, heads, tokens, head_width)."""
        start, self.length = self.length, self.length + keys.shape[2]
        self.keys[:, :, start : self.length] = keys
        self.values[:, :, start : self.length] = values
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention; `dropout` on the attention weights and on the output, as
    nanoGPT's."""

    def __init__(self, hidden: int, heads: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"model.hidden ({hidden}) must divide by model.heads ({heads})")
        self.heads = heads
        self.head_width = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.proj = nn.Linear(hidden, hidden, bias=bias)
        self.attention_dropout = dropout
        self.output_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, cache: KeyValueCache | None = None) -> torch.Tensor:
        """`cache`: generation's, which `x` (all of the prompt, or one new token) extends."""
        # As many heads as qkv's output holds: all of them here, a share of them when its rows
        # are split (each share's q, k and v rows together).
        batch, length, _ = x.shape
        qkv = self.qkv(x).view(batch, length, 3, -1, self.head_width)
        q, k, v = qkv.transpose(1, 3).unbind(2)
        dropout_p = self.attention_dropout if self.training else 0.0
        causal = True
        if cache is not None:
            if cache.length and length > 1:
                raise ValueError("a cache is extended by the whole prompt, then one token a call")
            causal = not cache.length  # one new token attends to every token before it
            k, v = cache.extended(k, v)
        y = nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal
        )
        return self.output_dropout(self.proj(y.transpose(1, 2).reshape(batch, length, -1)))


class TransformerBlock(nn.Module):
    """Pre-norm block; `bias=False` drops the biases of its Linears and LayerNorms (nanoGPT's
    `bias`), `dropout` is nanoGPT's too (attention weights, and each residual branch's output).
    `gelu`: `erf`, the exact GELU, or `tanh`, its tanh approximation (GPT-2's)."""

    def __init__(
        self, hidden: int, heads: int, bias: bool = True, dropout: float = 0.0, gelu: str = "erf"
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, bias=bias)
        self.attention = CausalSelfAttention(hidden, heads, bias, dropout)
        self.norm2 = nn.LayerNorm(hidden, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden, bias=bias),
            nn.GELU(approximate="tanh" if gelu == "tanh" else "none"),
            nn.Linear(4 * hidden, hidden, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor, cache: KeyValueCache | None = None) -> torch.Tensor:
        # `cache` by keyword: tensor parallel's input hooks on `attention` take its one input.
        x = x + self.attention(self.norm1(x), cache=cache)
        return x + self.mlp(self.norm2(x))

    def residual_projections(self) -> tuple[nn.Linear, nn.Linear]:
        """The layers whose outputs are added to the residual stream."""
        return self.attention.proj, self.mlp[2]


GPT2_STD = 0.02


def init_like_gpt2(model: nn.Module) -> None:
    """GPT-2's initialisation (as nanoGPT's): normal(0, 0.02) for every Linear and Embedding
    weight, zero biases, and the weights of every block's `residual_projections()` at
    0.02 / sqrt(2 x blocks), so that the residual stream's variance does not grow with depth.
    A tied head is initialised once, through its embedding. torch's default (uniform, scaled by
    fan-in) leaves a tied head's N(0, 1) embedding with logits of norm ~sqrt(width), and the
    first loss far above ln(vocabulary)."""
    drawn: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding) and id(module.weight) not in drawn:
            drawn.add(id(module.weight))
            nn.init.normal_(module.weight, std=GPT2_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    blocks = [module for module in model.modules() if hasattr(module, "residual_projections")]
    for block in blocks:
        for projection in block.residual_projections():
            nn.init.normal_(projection.weight, std=GPT2_STD / math.sqrt(2 * len(blocks)))


class CachedDecoding:
    """Generation with a key/value cache for a stack of `TokenEmbedding`, `TransformerBlock`s
    and a head (`Transformer`, `GPT`); its `forward` (training's) stays nn.Sequential's."""

    def new_cache(self: Any, batch: int) -> list[KeyValueCache]:
        """An empty cache per block, for `batch` sequences of up to the model's positions."""
        embedding, *blocks, _ = self
        capacity, weight = len(embedding.positions), embedding.token.weight
        return [
            KeyValueCache(batch, b.attention.heads, capacity, b.attention.head_width, weight)
            for b in blocks
        ]

    def decode(self: Any, tokens: torch.Tensor, cache: list[KeyValueCache]) -> torch.Tensor:
        """The logits of `tokens` (batch, new tokens), which follow those in `cache`."""
        embedding, *blocks, head = self
        x = embedding(tokens, start=cache[0].length)
        for block, layer_cache in zip(blocks, cache, strict=True):
            x = block(x, cache=layer_cache)
        return head(x)


class Transformer(CachedDecoding, nn.Sequential):
    """A tiny causal language model: embedding, `depth` pre-norm blocks, norm + vocabulary head,
    initialised as GPT-2 (`init_like_gpt2`).

    Input: token ids (batch, seq_len); output: logits (batch, seq_len, vocab_size).
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        hidden: int,
        depth: int,
        heads: int,
        bias: bool = True,
        dropout: float = 0.0,
    ):
        (seq_len,) = input_shape
        super().__init__(
            TokenEmbedding(num_classes, seq_len, hidden, dropout),
            *[TransformerBlock(hidden, heads, bias, dropout) for _ in range(depth)],
            nn.Sequential(
                nn.LayerNorm(hidden, bias=bias), nn.Linear(hidden, num_classes, bias=bias)
            ),
        )
        init_like_gpt2(self)


def padded_vocab(num_classes: int, vocab_multiple: int) -> int:
    """`num_classes` rounded up to a multiple of `vocab_multiple` (model.vocab_multiple)."""
    if vocab_multiple < 1:
        raise ValueError(f"model.vocab_multiple must be at least 1, got {vocab_multiple}")
    return -(-num_classes // vocab_multiple) * vocab_multiple


class GPT(CachedDecoding, nn.Sequential):
    """A GPT-2-style decoder: token + position embedding, `n_layer` pre-norm blocks of `n_head`
    heads, final norm and a bias-free vocabulary head, with the head's weight tied to the token
    embedding when `tie_weights`, initialised as GPT-2 (`init_like_gpt2`). Input: token ids
    (batch, seq_len); output: logits (batch, seq_len, vocab_size rounded up to a multiple of
    `vocab_multiple`). `bias` and `dropout` are nanoGPT's (its own default: `bias=False`), `gelu`
    the feed-forwards' (`TransformerBlock`). It reads and writes GPT-2's weights as transformers
    holds them (`gpt2_format`)."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        tie_weights: bool = True,
        vocab_multiple: int = 1,
        bias: bool = True,
        dropout: float = 0.0,
        gelu: str = "erf",
    ):
        (seq_len,) = input_shape
        vocab = padded_vocab(num_classes, vocab_multiple)
        embedding = TokenEmbedding(vocab, seq_len, n_embd, dropout)
        head = nn.Sequential(nn.LayerNorm(n_embd, bias=bias), nn.Linear(n_embd, vocab, bias=False))
        if tie_weights:
            head[1].weight = embedding.token.weight
        blocks = [TransformerBlock(n_embd, n_head, bias, dropout, gelu) for _ in range(n_layer)]
        super().__init__(embedding, *blocks, head)
        init_like_gpt2(self)

    def from_hf_format(
        self, weights: dict[str, torch.Tensor], config: dict[str, Any] | None
    ) -> dict[str, torch.Tensor]:
        """GPT-2's weights as transformers holds them (`config`: its config.json, if any) in this
        model's keys (`trainer.init_from`)."""
        return gpt2_format.from_gpt2(self, weights, config)

    def save_pretrained(self, folder: str | Path) -> None:
        """This model as transformers' GPT-2 (`GPT2LMHeadModel`) in `folder`: config.json and
        model.safetensors, which `from_pretrained` loads to the same logits."""
        gpt2_format.save_gpt2(self, Path(folder))
