"""nanoGPT's own settings of its GPT, `model.bias` and `model.dropout`, under the strategies:
without biases every strategy still trains `single`'s weights; with dropout only a strategy whose
masks come from one random stream in `single`'s order does (docs/strategies.md#dropout)."""

from __future__ import annotations

import pytest
from helpers import (
    TINY_GPT_SGD,
    assert_same_training,
    strategy_runs,
    train_losses,
)
from torch import nn

from src.components.models import GPT

# nanoGPT's default layout: no biases in the Linears and LayerNorms.
NANOGPT = (*TINY_GPT_SGD, "model.bias=false")
# Its weight average, evaluated and checkpointed at step 3 too (tests/test_ema.py).
NANOGPT = (*NANOGPT, "trainer.ema_decay=0.5", "trainer.ema_eval=true", "trainer.checkpoint_every=3")
WITHOUT_BIASES = ("ddp", "tp")
WITH_DROPOUT = (*NANOGPT, "model.dropout=0.1")
ONE_STREAM = ("model_parallel",)  # one process, its stages one after another on the CPU
OWN_STREAMS = ("dp", "ddp", "tp")  # replicas in threads, ranks, and ranks holding their heads


def test_bias_false_removes_every_bias_as_nanogpt_does():
    gpt = GPT((8,), 16, n_layer=2, n_head=2, n_embd=32, bias=False)
    assert [name for name, _ in gpt.named_parameters() if "bias" in name] == []
    norms = [module for module in gpt.modules() if isinstance(module, nn.LayerNorm)]
    assert len(norms) == 5 and all(norm.bias is None and norm.weight is not None for norm in norms)


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", WITHOUT_BIASES)
def test_a_gpt_without_biases_trains_like_single(strategy):
    runs = strategy_runs(*NANOGPT, strategies=WITHOUT_BIASES)
    losses = train_losses(runs["single"])
    assert losses[-1] < losses[0] - 0.1
    assert_same_training(runs["single"], runs[strategy])


def dropout_runs() -> dict:
    return strategy_runs(*WITH_DROPOUT, strategies=(*ONE_STREAM, *OWN_STREAMS))


def largest_loss_difference(reference: list[float], other: list[float]) -> float:
    assert len(other) == len(reference)
    return max(abs(a - b) for a, b in zip(reference, other, strict=True))


@pytest.mark.equivalence
def test_dropout_changes_what_single_trains():
    """So that the tests below compare masks, not an identity."""
    with_dropout = train_losses(dropout_runs()["single"])
    without = train_losses(strategy_runs(*NANOGPT, strategies=WITHOUT_BIASES)["single"])
    assert largest_loss_difference(without, with_dropout) > 1e-3


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", ONE_STREAM)
def test_with_dropout_one_random_stream_trains_like_single(strategy):
    runs = dropout_runs()
    assert_same_training(runs["single"], runs[strategy])


@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", OWN_STREAMS)
def test_with_dropout_replicas_and_ranks_draw_other_masks_than_single(strategy):
    runs = dropout_runs()
    losses = train_losses(runs[strategy])
    assert losses[-1] < losses[0] - 0.1  # it trains, with masks of its own
    assert largest_loss_difference(train_losses(runs["single"]), losses) > 1e-4
