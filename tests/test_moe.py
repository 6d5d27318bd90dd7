"""`model=moe`: the router's top-k choices, capacity's drops and the load-balancing loss on
hand-built routings, the loss exact under any split of a batch, and the model trained under ddp,
fsdp and pp to `single`'s weights (SGD) through `train.py`, its aux loss logged."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TINY_GPT_SGD, assert_same_training, metrics, strategy_runs, train_losses

from src.components.moe import (
    MoEFeedForward,
    MoEGPT,
    balance_loss,
    combine,
    dispatch,
    expert_capacity,
    route,
)

# 4 experts, 2 per token, 8 tokens a sequence: 3 slots per expert (0.75 x 2 x 8 / 4), 12 for a
# sequence's 16 choices, so every sequence drops at least 4.
MOE_SGD = (
    *(override for override in TINY_GPT_SGD if override != "model=gpt"),
    "model=moe",
    "task=language_model",
    "model.experts=4",
    "model.capacity_factor=0.75",
    "model.aux_loss_weight=0.1",
    "model.tie_weights=false",  # the experts' proofs; a tied head under pp: tests/test_tasks.py
)
LAYOUTS = ("ddp", "fsdp", "pp")


def one_sequence(*rows: list[float]) -> torch.Tensor:
    """Router probabilities of one sequence, a row per token: (1, seq, experts)."""
    return torch.tensor([rows])


def test_top_1_routes_each_token_to_its_likeliest_expert_in_token_order():
    probabilities = one_sequence([0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.1, 0.4])
    routing = route(probabilities, top_k=1, capacity=3)
    assert routing.expert.flatten().tolist() == [0, 1, 0]
    assert routing.gate.flatten().tolist() == pytest.approx([0.7, 0.6, 0.5])
    assert routing.slot.flatten().tolist() == [0, 0, 1]  # token 2 queues behind token 0
    assert routing.load(3).tolist() == [[2, 1, 0]]


def test_top_2_queues_every_first_choice_before_any_second_choice():
    probabilities = one_sequence([0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.5, 0.4, 0.1])
    routing = route(probabilities, top_k=2, capacity=6)
    assert routing.expert.tolist() == [[[0, 1], [1, 0], [0, 1]]]
    assert routing.gate.flatten().tolist() == pytest.approx([0.6, 0.3, 0.7, 0.2, 0.5, 0.4])
    # Expert 0: first choices of tokens 0 and 2, then token 1's second choice.
    assert routing.slot.tolist() == [[[0, 1], [0, 2], [1, 2]]]
    assert routing.load(3).tolist() == [[3, 3, 0]]


def test_choices_past_capacity_are_dropped_and_their_tokens_keep_only_the_residual():
    """Four tokens all prefer expert 0, which has 2 slots: tokens 2 and 3 are dropped (top 1),
    and their feed-forward output is exactly zero."""
    layer = MoEFeedForward(width=4, experts=2, top_k=1, capacity_factor=1.0)
    assert expert_capacity(4, experts=2, top_k=1, capacity_factor=1.0) == 2
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0]]))
    tokens = torch.tensor([[[1.0, 2, 3, 4], [2, 1, 0, 1], [3, 0, 1, 2], [1, 1, 1, 1]]])
    routing = route(layer.router(tokens).softmax(-1), top_k=1, capacity=2)
    assert routing.kept.flatten().tolist() == [True, True, False, False]
    output, _ = layer(tokens)
    assert output[0, 2:].eq(0).all() and output[0, :2].ne(0).all()


def test_dispatch_and_combine_place_each_kept_choice_once():
    """Experts that return their tokens give back each token times the gates of its kept
    choices; every slot holds at most one token."""
    torch.manual_seed(0)
    tokens = torch.randn(3, 5, 4)
    routing = route(torch.randn(3, 5, 4).softmax(-1), top_k=2, capacity=2)
    grouped = dispatch(tokens, routing, experts=4)
    assert grouped.shape == (4, 3 * 2, 4)
    assert int(grouped.ne(0).any(-1).sum()) == int(routing.kept.sum())
    expected = tokens * (routing.gate * routing.kept).sum(-1, keepdim=True)
    torch.testing.assert_close(combine(grouped, routing), expected)


def test_the_balance_loss_is_switchs_per_sequence():
    """Summed over a sequence's tokens, seq_len x experts x sum_i f_i P_i: 1 per token at an
    even load with even probabilities, and E x sum f_i P_i otherwise."""
    even = one_sequence([0.75, 0.25], [0.25, 0.75], [0.75, 0.25], [0.25, 0.75])
    assert balance_loss(even, route(even, top_k=1, capacity=4)).tolist() == [[1.0] * 4]
    skewed = one_sequence([0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4])
    routing = route(skewed, top_k=1, capacity=4)  # all four to expert 0: f = (1, 0)
    switch = 2 * (1.0 * skewed[..., 0].mean() + 0.0 * skewed[..., 1].mean())
    assert balance_loss(skewed, routing).sum().item() == pytest.approx(4 * switch.item())


@pytest.mark.parametrize("top_k", [1, 2])
def test_any_split_of_a_batch_gives_the_same_outputs_and_aux_loss(top_k):
    """What ddp's, fsdp's and the micro-batches' shares rebuild: capacity and the loss are per
    sequence."""
    torch.manual_seed(0)
    model = MoEGPT((8,), 16, 2, 2, 16, experts=4, top_k=top_k, capacity_factor=0.75,
                   aux_loss_weight=0.1)  # fmt: skip
    tokens = torch.randint(16, (5, 8))
    with torch.no_grad():
        whole = model(tokens)
        parts = [model(tokens[:2]), model(tokens[2:])]
    for index in range(2):  # the logits and the aux loss
        torch.testing.assert_close(torch.cat([part[index] for part in parts]), whole[index])


def test_an_untrained_moe_starts_at_ln_vocabulary_with_an_even_load():
    torch.manual_seed(0)
    vocab, layers, weight = 4096, 2, 0.01
    model = MoEGPT((16,), vocab, layers, 2, 64, experts=4, top_k=2, capacity_factor=1.25,
                   aux_loss_weight=weight)  # fmt: skip
    tokens = torch.randint(vocab, (4, 17))
    with torch.no_grad():
        logits, aux_loss = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert abs(loss.item() - math.log(vocab)) < 0.3
    per_token = aux_loss / 16 / (layers * weight)  # per block: 1 at an even load
    assert per_token.tolist() == pytest.approx([1.0] * 4, abs=0.1)


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_trains_exactly_like_single(layout):
    """One sweep: single, ddp, fsdp and pp (2 processes each), top 2 under a capacity that drops
    choices; every step's loss (aux loss included) and the final weights."""
    runs = strategy_runs(*MOE_SGD, strategies=LAYOUTS)
    assert_same_training(runs["single"], runs[layout])
    single, other = metrics(runs["single"]), metrics(runs[layout])
    for logged in ("train/aux_loss", "val/aux_loss"):
        expected = [row[logged] for row in single if logged in row]
        assert [row[logged] for row in other if logged in row] == pytest.approx(expected, abs=1e-6)


def test_the_aux_loss_is_logged_and_the_loss_falls():
    runs = strategy_runs(*MOE_SGD, strategies=LAYOUTS)
    logged = metrics(runs["single"])
    aux_losses = [row["train/aux_loss"] for row in logged if "train/aux_loss" in row]
    # Two blocks at weight 0.1, each at least 1 (an even load) per token.
    assert len(aux_losses) == 6 and all(0.2 <= aux < 0.4 for aux in aux_losses)
    losses = train_losses(runs["single"])
    assert losses[-1] < losses[0] - 0.1
