"""A mixture-of-experts GPT: GPT-2's blocks (`models.py`) with each feed-forward replaced by
`experts` feed-forwards, of which a router picks `top_k` per token.

What the model computes is defined per sequence, so that any split of a batch by samples (ddp's
and fsdp's shares, accumulation's and a pipeline's micro-batches) reproduces it exactly:

- Capacity: each expert takes at most `capacity_factor x top_k x seq_len / experts` (rounded up)
  of a sequence's tokens. A sequence queues its tokens' first choices in token order, then their
  second choices (GShard's priority); a choice past its expert's capacity is dropped, and a token
  whose every choice is dropped passes through on the residual alone.
- Load-balancing loss: Switch's `experts x sum_i f_i P_i` (f_i the share of the sequence's
  choices that go to expert i, P_i its mean router probability), taken over each sequence rather
  than over the batch. Over the batch, f and P are batch means whose product no split of the
  batch can rebuild from its parts; per sequence it is each token's
  `experts x sum_i f_i p_i(token)`, a per-token term, which the loop's sums add up and divide by
  the number of targets exactly as they do the cross-entropy. (DeepSeek-V3 also balances per
  sequence.)

Expert parallel keeps these numbers: routing, capacity and the loss are decided where the
sequence is, before any exchange; only `Experts` (tokens grouped by expert -> their outputs) runs
where the experts are (`MoEFeedForward.expert_outputs` is the call it replaces). Their weights
are stacked (experts x in x out) for it to shard on dim 0.

The blocks hand on one tensor, the residual stream with one extra channel that carries each
token's load-balancing loss so far, so that the model stays an `nn.Sequential` of blocks whose
boundaries pipeline stages can cut anywhere. The head returns (logits, aux loss), the aux loss
weighted and summed over each sample's tokens, which `tasks.LanguageModel` adds to its loss (a
tuple, not a dict: torch's pipeline stages take a tensor or a tuple of tensors, the last too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from src.components.models import (
    GPT2_STD,
    CausalSelfAttention,
    TokenEmbedding,
    init_like_gpt2,
    padded_vocab,
)


def with_aux_loss(hidden: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """The residual stream (batch, seq, width) with each token's aux loss (batch, seq) as one
    more channel: what the blocks hand on."""
    return torch.cat([hidden, aux_loss.unsqueeze(-1).to(hidden.dtype)], dim=-1)


def split_aux_loss(stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`with_aux_loss`'s parts back: (hidden, per-token aux loss)."""
    return stream[..., :-1], stream[..., -1]


def expert_capacity(seq_len: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per sequence: capacity_factor x its even share of the sequence's
    choices, rounded up; never more than the sequence's tokens (each picks an expert once)."""
    return min(seq_len, math.ceil(capacity_factor * top_k * seq_len / experts))


@dataclass
class Routing:
    """Where each token's `top_k` choices go, all (batch, seq, top_k)."""

    expert: torch.Tensor
    """The chosen experts, the likeliest first."""
    gate: torch.Tensor
    """The router's probability of each chosen expert: the weight of its output."""
    slot: torch.Tensor
    """The choice's place in its expert's queue for the sequence (0, 1, ...)."""
    capacity: int
    """Slots per expert per sequence."""

    @property
    def kept(self) -> torch.Tensor:
        """The choices within their expert's capacity."""
        return self.slot < self.capacity

    def load(self, experts: int) -> torch.Tensor:
        """Choices per (sequence, expert), before capacity drops any: (batch, experts)."""
        chosen = F.one_hot(self.expert.flatten(1), experts)
        return chosen.sum(1)


def route(probabilities: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """The `top_k` likeliest experts of each token in `probabilities` (batch, seq, experts), and
    each choice's slot: its sequence's first choices queue in token order before its second."""
    batch, seq_len, experts = probabilities.shape
    gate, expert = probabilities.topk(top_k, dim=-1)
    queue_order = expert.transpose(1, 2).reshape(batch, top_k * seq_len)
    chosen = torch.zeros(batch, top_k * seq_len, experts, device=expert.device, dtype=torch.long)
    chosen.scatter_(-1, queue_order.unsqueeze(-1), 1)
    ahead = chosen.cumsum(1) - chosen  # earlier choices of the same expert in the queue
    slot = ahead.gather(-1, queue_order.unsqueeze(-1)).view(batch, top_k, seq_len)
    return Routing(expert, gate, slot.transpose(1, 2), capacity)


def slot_index(routing: Routing, experts: int) -> torch.Tensor:
    """Each choice's row in the experts' (experts x batch x capacity) slots, flattened; a dropped
    choice's is the one row past them."""
    batch = routing.expert.shape[0]
    sample = torch.arange(batch, device=routing.expert.device).view(batch, 1, 1)
    index = (routing.expert * batch + sample) * routing.capacity + routing.slot
    return torch.where(routing.kept, index, experts * batch * routing.capacity)


def dispatch(tokens: torch.Tensor, routing: Routing, experts: int) -> torch.Tensor:
    """`tokens` (batch, seq, width) grouped by expert: (experts, batch x capacity, width), each
    kept choice in its slot, the unfilled slots zero."""
    batch, _, width = tokens.shape
    rows = experts * batch * routing.capacity
    index = slot_index(routing, experts).flatten()
    copies = tokens.unsqueeze(2).expand(*routing.expert.shape, width).reshape(-1, width)
    grouped = tokens.new_zeros(rows + 1, width).index_add(0, index, copies)
    return grouped[:rows].view(experts, batch * routing.capacity, width)


def combine(expert_outputs: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token's kept choices' outputs, weighted by their gates and summed: (batch, seq,
    width); zero for a token whose every choice was dropped."""
    experts, _, width = expert_outputs.shape
    rows = torch.cat([expert_outputs.reshape(-1, width), expert_outputs.new_zeros(1, width)])
    picked = rows[slot_index(routing, experts)]  # (batch, seq, top_k, width)
    return (picked * routing.gate.unsqueeze(-1).to(picked.dtype)).sum(2)


def balance_loss(probabilities: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token's share of its sequence's Switch load-balancing loss, (batch, seq):
    experts x sum_i f_i p_i(token), f_i the share of the sequence's choices that picked expert
    i. Summed over a sequence's tokens it is seq_len x Switch's loss of the sequence (1 when the
    load and the probabilities are even)."""
    experts = probabilities.shape[-1]
    load = routing.load(experts).to(probabilities.dtype)
    share = load / routing.expert[0].numel()  # f_i over the sequence's seq x top_k choices
    return experts * (probabilities * share.unsqueeze(1)).sum(-1)


class ExpertLinear(nn.Module):
    """One Linear layer per expert, their weights stacked (experts, in, out) and biases
    (experts, out): input (experts, tokens, in), each expert's tokens through its own. Drawn as
    `init_like_gpt2` draws a Linear: normal(0, 0.02) weights, zero biases."""

    def __init__(self, experts: int, features_in: int, features_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, features_in, features_out) * GPT2_STD)
        self.bias = nn.Parameter(torch.zeros(experts, features_out))

    def forward(self, grouped: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias.unsqueeze(1), grouped, self.weight)


class Experts(nn.Module):
    """`experts` GPT-2 feed-forwards (width -> 4 x width -> width, GELU): tokens grouped by
    expert (experts, tokens, width) in, their outputs out, the same shape. Expert parallel puts
    its exchange of tokens around this call."""

    def __init__(self, experts: int, width: int):
        super().__init__()
        self.up = ExpertLinear(experts, width, 4 * width)
        self.down = ExpertLinear(experts, 4 * width, width)

    def forward(self, grouped: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(grouped)))


class MoEFeedForward(nn.Module):
    """A bias-free linear router, its top-k routing under capacity, and the experts."""

    def __init__(self, width: int, experts: int, top_k: int, capacity_factor: float):
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = Experts(experts, width)
        self.top_k, self.capacity_factor = top_k, capacity_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens' combined expert outputs (batch, seq, width) and their load-balancing
        loss terms (batch, seq)."""
        experts = self.router.out_features
        probabilities = self.router(x).float().softmax(-1)
        capacity = expert_capacity(x.shape[1], experts, self.top_k, self.capacity_factor)
        routing = route(probabilities, self.top_k, capacity)
        outputs = self.expert_outputs(x, routing)
        return outputs.to(x.dtype), balance_loss(probabilities, routing)

    def expert_outputs(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Each token's kept choices through their experts, combined (batch, seq, width).
        Expert parallel replaces this call on the layer (`src/parallel/ep/apply.py`)."""
        return combine(self.experts(dispatch(x, routing, self.router.out_features)), routing)


class MoEBlock(nn.Module):
    """GPT-2's pre-norm block with a mixture of experts for its feed-forward; it adds
    `aux_loss_weight` x its load-balancing terms to the stream's aux loss channel."""

    def __init__(
        self,
        width: int,
        heads: int,
        experts: int,
        top_k: int,
        capacity_factor: float,
        aux_loss_weight: float,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.moe = MoEFeedForward(width, experts, top_k, capacity_factor)
        self.aux_loss_weight = aux_loss_weight

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        x, aux_loss = split_aux_loss(stream)
        x = x + self.attention(self.norm1(x))
        y, balance = self.moe(self.norm2(x))
        return with_aux_loss(x + y, aux_loss + self.aux_loss_weight * balance)

    def residual_projections(self) -> tuple[nn.Module, nn.Module]:
        """The layers whose outputs are added to the residual stream."""
        return self.attention.proj, self.moe.experts.down


class MoEEmbedding(TokenEmbedding):
    """GPT's token + position embedding, with the aux loss channel at zero."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = super().forward(tokens)
        return with_aux_loss(hidden, hidden.new_zeros(hidden.shape[:-1]))


class MoEHead(nn.Module):
    """Final norm and bias-free vocabulary head: (logits (batch, seq, vocab), aux loss (batch,),
    each sample's summed over its tokens)."""

    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, vocab, bias=False)

    def forward(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux_loss = split_aux_loss(stream)
        return self.linear(self.norm(x)), aux_loss.float().sum(1)


class MoEGPT(nn.Sequential):
    """GPT (`models.GPT`) whose blocks' feed-forwards are mixtures of `experts` experts, `top_k`
    (1 or 2) per token, under `capacity_factor`, with the load-balancing loss at
    `aux_loss_weight` per block. Input: token ids (batch, seq_len); output: (logits (batch,
    seq_len, vocab), aux loss (batch,))."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        experts: int,
        top_k: int,
        capacity_factor: float,
        aux_loss_weight: float,
        tie_weights: bool = True,
        vocab_multiple: int = 1,
    ):
        (seq_len,) = input_shape
        if top_k not in (1, 2) or top_k > experts:
            raise ValueError(
                f"model.top_k must be 1 or 2 and at most model.experts ({experts}), got {top_k}"
            )
        if capacity_factor <= 0 or aux_loss_weight < 0:
            raise ValueError(
                f"model.capacity_factor must be above 0 (got {capacity_factor}) and "
                f"model.aux_loss_weight at least 0 (got {aux_loss_weight})"
            )
        vocab = padded_vocab(num_classes, vocab_multiple)
        embedding = MoEEmbedding(vocab, seq_len, n_embd)
        head = MoEHead(n_embd, vocab)
        if tie_weights:
            head.linear.weight = embedding.token.weight
        blocks = [
            MoEBlock(n_embd, n_head, experts, top_k, capacity_factor, aux_loss_weight)
            for _ in range(n_layer)
        ]
        super().__init__(embedding, *blocks, head)
        init_like_gpt2(self)
