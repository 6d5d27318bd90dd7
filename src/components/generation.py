"""Text out: a causal language model's next tokens, one at a time, as nanoGPT's `generate` makes
them: the most likely (`temperature` 0: greedy), or drawn from the softmax of the logits over
`temperature`, among the `top_k` most likely.

A model with `new_cache` and `decode` (`models.CachedDecoding`: gpt, transformer; transformers'
models, with their own cache: `hf.py`) keeps each layer's keys and values in a cache, so a new
token costs one token's compute; any other model (moe) runs its whole context again for each
token. Past the model's positions the
context is cropped to its last `context` tokens (nanoGPT's way): every position then moves, so the
cache starts again from the cropped context, and both ways give the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_k: int | None  # None: every token


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    sampling: Sampling,
    context: int,
    logits_of: Callable[[Any], torch.Tensor],
    cached: bool = True,
) -> torch.Tensor:
    """`prompt` (batch, tokens) followed by `sampling.max_new_tokens` tokens, each chosen from
    the model's logits (`logits_of` its outputs) after at most `context` tokens before it.
    `cached`: with a key/value cache where the model has one."""
    cached = cached and hasattr(model, "new_cache")
    tokens, cache, seen = prompt, None, 0  # `seen`: the tokens in the cache
    for _ in range(sampling.max_new_tokens):
        window = tokens[:, -context:]
        if not cached:
            logits = logits_of(model(window))
        else:
            if cache is None or tokens.shape[1] > context:  # cropped: every position moved
                cache, seen = model.new_cache(len(tokens)), 0
            logits = logits_of(model.decode(window[:, seen:], cache))
            seen = window.shape[1]
        tokens = torch.cat([tokens, next_tokens(logits[:, -1], sampling)], dim=1)
    return tokens


def next_tokens(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One token (batch, 1) for each row of (batch, vocab) `logits`."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1)
