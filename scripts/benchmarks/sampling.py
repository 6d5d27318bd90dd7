"""Text out: sample.py's decoding (`components/generation.py`, the GPT's key/value cache) against
transformers' `generate` with its cache, on the same weights (the GPT exported in the HF format)
and device: `sample`. Both draw `steps` tokens after a 16-token prompt, temperature 0.8 among the
top 200, one sequence at a time (nanoGPT's sample.py's way); the figures are tokens/s."""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

from benchmarks import workload
from src.components.generation import Sampling, generate
from src.components.models import GPT
from src.components.tasks import LanguageModel

SAMPLE_BATCH = 1
PROMPT_TOKENS = 16
TEMPERATURE, TOP_K = 0.8, 200
VOCAB = 50257  # GPT-2's
WARMUP_TOKENS = 8


@functools.cache
def models(device: str) -> tuple[GPT, nn.Module, int]:
    """A GPT with random weights (gpt2_124m's shape on a GPU, 4 blocks 256 wide over 512
    positions on a CPU), transformers' GPT-2 loaded from its export, both on `device`, and
    their positions."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    sizes = {"n_layer": 12, "n_head": 12, "n_embd": 768} if device == "cuda" else {}
    sizes = sizes or {"n_layer": 4, "n_head": 4, "n_embd": 256}
    positions = 1024 if device == "cuda" else 512
    torch.manual_seed(0)
    ours = GPT((positions,), VOCAB, gelu="tanh", **sizes).eval()
    with tempfile.TemporaryDirectory() as folder:
        ours.save_pretrained(folder)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return ours.to(device), theirs.eval().to(device), positions


def tokens_per_second(steps: int, sample: Callable[[torch.Tensor, int], torch.Tensor]) -> float:
    """New tokens per second of `sample(prompt, new_tokens)` (after a short warm-up)."""
    _, _, positions = models(workload.DEVICE)
    new_tokens = min(steps, positions - PROMPT_TOKENS)
    prompt = torch.randint(VOCAB, (SAMPLE_BATCH, PROMPT_TOKENS), device=workload.DEVICE)
    sample(prompt, WARMUP_TOKENS)
    synchronize()
    start = time.perf_counter()
    tokens = sample(prompt, new_tokens)
    synchronize()
    seconds = time.perf_counter() - start
    assert tokens.shape[1] == PROMPT_TOKENS + new_tokens, tokens.shape
    return SAMPLE_BATCH * new_tokens / seconds


def synchronize() -> None:
    if workload.DEVICE == "cuda":
        torch.cuda.synchronize()


def template_sample(steps: int) -> float:
    ours, _, positions = models(workload.DEVICE)

    def sample(prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        sampling = Sampling(new_tokens, TEMPERATURE, TOP_K)
        return generate(ours, prompt, sampling, positions, LanguageModel.logits)

    return tokens_per_second(steps, sample)


def transformers_sample(steps: int) -> float:
    _, theirs, _ = models(workload.DEVICE)

    @torch.no_grad()
    def sample(prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return theirs.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            temperature=TEMPERATURE,
            top_k=TOP_K,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # no stop at GPT-2's end-of-text token
            pad_token_id=0,
        )

    return tokens_per_second(steps, sample)
