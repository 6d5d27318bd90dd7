"""Context parallel's ring attention on CPU (src/parallel/cp/ring.py), on real gloo
process groups: causal attention of the template's shapes, split over 2 and 4 ranks, gives
single-process SDPA's outputs and gradients; torch's own `context_parallel` fails on CPU without
`ring_cpu_flash_attention` and runs with it. The 4 ranks, forked from the rank server (which has
imported torch), take about 1.2 s of CPU each."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import forked_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel import _attention

from src.components.models import GPT, MLP, CausalSelfAttention
from src.config.base import ConfigError
from src.parallel.cp.apply import check_attention, check_sequence_length, shard_sequence
from src.parallel.cp.ring import (
    CPU_FLASH,
    CPU_FLASH_BACKWARD,
    check_torch_ring,
    ring_attention,
    ring_cpu_flash_attention,
)

# The template's attention: model.hidden 32 over 4 heads (head size 8), data.seq_len 32.
BATCH, HEADS, LENGTH, HEAD_SIZE = 2, 4, 32, 8
HIDDEN = HEADS * HEAD_SIZE
TOLERANCE = 1e-5


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.allclose(got, want, rtol=0, atol=TOLERANCE), (what, (got - want).abs().max())


def single_attention() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Query, key, value and an output gradient, and single's output and q, k, v gradients."""
    torch.manual_seed(0)
    qkv = [torch.randn(BATCH, HEADS, LENGTH, HEAD_SIZE, requires_grad=True) for _ in range(3)]
    out = F.scaled_dot_product_attention(*qkv, is_causal=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    inputs = [t.detach() for t in qkv] + [grad]
    return inputs, [out.detach()] + [t.grad for t in qkv]


def torch_rings_cpu_only_when_told(mesh: DeviceMesh) -> None:
    """torch's `context_parallel` (which shards its buffers in place) fails on SDPA's CPU kernel
    until `ring_cpu_flash_attention` has run; then it gives single's output on this rank's
    share, cut as `shard_sequence` cuts it."""
    (q, k, v, _), (out, *_) = single_attention()
    propagator = DTensor._op_dispatcher.sharding_propagator
    rules = {**propagator.op_strategy_funcs, **propagator.op_single_dim_strategy_funcs}
    assert CPU_FLASH not in rules and CPU_FLASH_BACKWARD not in rules  # `sequence_sharding`'s own
    native = [t.clone() for t in (q, k, v)]
    with (
        pytest.raises(NotImplementedError, match="flash_attention_for_cpu"),
        context_parallel(mesh, buffers=native, buffer_seq_dims=[2, 2, 2]),
    ):
        F.scaled_dot_product_attention(*native, is_causal=True)
    # ^ Once this fails, torch rings the CPU kernel itself: drop `ring_cpu_flash_attention`.
    ring_cpu_flash_attention()
    buffers = [t.clone() for t in (q, k, v)]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
        ringed = F.scaled_dot_product_attention(*buffers, is_causal=True)
    assert_close(ringed, shard_sequence(mesh, [out], [2])[0], "torch's context_parallel")


def ring_refuses_inputs_not_split_along_the_sequence(mesh: DeviceMesh) -> None:
    """Replicated or head-split inputs reach the ring's handler only by a direct call: it
    refuses them rather than ring whole tensors."""
    q = torch.randn(BATCH, HEADS, LENGTH, HEAD_SIZE)
    for placement in (Replicate(), Shard(1)):
        d = distribute_tensor(q, mesh, [placement])
        with ring_attention(mesh), pytest.raises(RuntimeError, match="split along the sequence"):
            CPU_FLASH(d, d, d, 0.0, True)


def sdpa_rings_as_single(mesh: DeviceMesh) -> None:
    """Under `ring_attention`, SDPA on this rank's shards gives its shards of single's output
    and of the query, key and value gradients."""
    inputs, wanted = single_attention()
    *qkv, grad = shard_sequence(mesh, inputs, [2] * 4)
    qkv = [t.requires_grad_() for t in qkv]
    with ring_attention(mesh):
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
        out.backward(grad)
    got = [out.detach()] + [t.grad for t in qkv]
    wanted = shard_sequence(mesh, wanted, [2] * 4)
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, wanted, strict=True):
        assert_close(g, w, name)


def attention_layer_rings_as_single(mesh: DeviceMesh) -> None:
    """The template's `CausalSelfAttention` on this rank's tokens: its outputs and input
    gradients are its shares of single's, and its weight gradients, summed over the cp ranks (as
    the degree's gradient reduction must), single's."""
    torch.manual_seed(1)
    layer = CausalSelfAttention(HIDDEN, HEADS)
    x = torch.randn(BATCH, LENGTH, HIDDEN, requires_grad=True)
    grad = torch.randn(BATCH, LENGTH, HIDDEN)
    y = layer(x)
    y.backward(grad)
    weights = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    local_x, local_grad = shard_sequence(mesh, [x.detach(), grad], [1, 1])
    local_x.requires_grad_()
    with ring_attention(mesh):
        local_y = layer(local_x)
        local_y.backward(local_grad)
    want_y, want_dx = shard_sequence(mesh, [y.detach(), x.grad], [1, 1])
    assert_close(local_y.detach(), want_y, "output")
    assert_close(local_x.grad, want_dx, "input gradient")
    for parameter, want in zip(layer.parameters(), weights, strict=True):
        dist.all_reduce(parameter.grad, group=mesh.get_group())
        assert_close(parameter.grad, want, "weight gradient")


def batch_shares_keep_their_pairs(mesh: DeviceMesh) -> None:
    """Token ids, labels and positions keep their pairs, head-tail ordered, and the ranks'
    shares cover each sequence once."""
    tokens = torch.randint(0, 1000, (BATCH, LENGTH + 1))
    positions = torch.arange(LENGTH).expand(BATCH, LENGTH)
    ids, labels, where = shard_sequence(mesh, [tokens[:, :-1], tokens[:, 1:], positions], [1, 1, 1])
    assert torch.equal(ids, tokens.gather(1, where)) and torch.equal(
        labels, tokens.gather(1, where + 1)
    )
    chunk = LENGTH // (2 * mesh.size())
    rank = mesh.get_local_rank()
    heads_and_tails = [rank * chunk, (2 * mesh.size() - 1 - rank) * chunk]
    assert where[0, ::chunk].tolist() == heads_and_tails
    everyone = [torch.empty_like(where) for _ in range(mesh.size())]
    dist.all_gather(everyone, where.contiguous(), group=mesh.get_group())
    assert torch.equal(torch.cat(everyone, 1).sort(1).values, positions)


def cp_rank(rank: int, store: str) -> None:
    """One of 4 ranks: cp 2 (on each dp row of a 2 x 2 mesh, as the degree's sub-mesh) and cp 4."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    dp_by_cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    torch_rings_cpu_only_when_told(dp_by_cp["cp"])
    ring_refuses_inputs_not_split_along_the_sequence(dp_by_cp["cp"])
    for mesh in (dp_by_cp["cp"], init_device_mesh("cpu", (4,))):
        sdpa_rings_as_single(mesh)
        attention_layer_rings_as_single(mesh)
        batch_shares_keep_their_pairs(mesh)
    dist.destroy_process_group()


@pytest.mark.equivalence
def test_ring_attention_on_cpu_computes_single_s_attention_on_2_and_4_ranks(tmp_path):
    """The ranks are forked from the rank server, which has imported torch (seconds a rank)."""
    forked_ranks(cp_rank, str(tmp_path / "store"), processes=4)


def test_a_sequence_that_does_not_cut_into_2_x_cp_chunks_is_refused():
    check_sequence_length(32, 4)
    with pytest.raises(ConfigError, match=r"parallel.cp=4 .* 2 x cp = 8 .* 36 tokens"):
        check_sequence_length(36, 4)


class FullAttention(nn.Module):
    """Attention without a causal mask, or with an explicit one."""

    def __init__(self, explicit_mask: bool):
        super().__init__()
        self.explicit_mask = explicit_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], 1, x.shape[1], -1)
        explicit = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device)
        mask = explicit if self.explicit_mask else None
        return F.scaled_dot_product_attention(
            q, q, q, attn_mask=mask if self.explicit_mask else None
        )


@pytest.mark.parametrize(
    ("model", "refusal"),
    [
        (MLP(input_shape=(8,), num_classes=4, hidden=8, depth=1), "the model runs none"),
        (FullAttention(explicit_mask=False), "has no \\(full attention\\) mask"),
        (FullAttention(explicit_mask=True), "has an explicit attn_mask mask"),
    ],
)
def test_cp_refuses_a_model_without_causal_attention(model, refusal):
    with pytest.raises(ConfigError, match=refusal):
        check_attention(model.to("meta"), torch.empty(2, 8, device="meta"))


def test_cp_refuses_attention_dropout_before_the_ring_fails_on_it():
    with torch.device("meta"):
        model = GPT(input_shape=(8,), num_classes=16, n_layer=1, n_head=2, n_embd=8, dropout=0.1)
    with pytest.raises(ConfigError, match=r"has a dropout \(0.1\) random mask.*model.dropout=0"):
        check_attention(model, torch.zeros(2, 8, dtype=torch.long, device="meta"))


def test_cp_takes_the_gpt_s_causal_attention_traced_on_the_meta_device():
    with torch.device("meta"):
        model = GPT(input_shape=(16,), num_classes=32, n_layer=2, n_head=2, n_embd=16)
    check_attention(model, torch.zeros(2, 16, dtype=torch.long, device="meta"))


def test_a_torch_without_the_ring_cp_uses_gets_one_line(monkeypatch):
    check_torch_ring()
    monkeypatch.delattr(_attention, "_templated_ring_attention_backward")
    with pytest.raises(
        ConfigError, match=re.escape(f"torch {torch.__version__} lacks _templated_ring")
    ):
        check_torch_ring()
