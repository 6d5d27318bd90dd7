"""Context parallel's ring: attention as a ring over the cp ranks (issue #43), each holding a
load-balanced share of every sequence (`apply.shard_sequence`), on CUDA or CPU.

The ring is torch's own (`torch.distributed.tensor.experimental._context_parallel`): under it,
SDPA's query, key and value become DTensors split along the sequence, and DTensor hands SDPA's
fused kernels to the ring's handlers. torch gives its CUDA kernels (flash, efficient, cuDNN) a
handler and a sharding rule; SDPA's CPU kernel, `_scaled_dot_product_flash_attention_for_cpu`,
gets neither, so on CPU `context_parallel` fails (torch 2.11 to 2.14.1: "... does not have a
sharding strategy registered"). `ring_cpu_flash_attention` gives it both, in the way torch gives
the CUDA ones theirs: its forward and backward run torch's ring (`_templated_ring_attention` and
its backward) with the CPU kernel in place of the CUDA one. The rest (head-tail load balancing,
the merge of the blocks' outputs by their log-sum-exp, the rotation of keys and values) is
torch's. `tests/test_context_parallel.py` fails once torch rings the CPU kernel itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, OutputSharding
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
from torch.distributed.tensor.experimental._context_parallel import _attention, _load_balancer

from src.config.base import ConfigError

SEQUENCE_DIM = 2
"""Of SDPA's query, key and value: (batch, heads, sequence, head size)."""

aten = torch.ops.aten
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

TORCH_RING = (
    (_attention, "_templated_ring_attention"),
    (_attention, "_templated_ring_attention_backward"),
    (_attention, "custom_ops"),
    (_attention, "_cp_options"),
    (_attention, "_enable_context_parallel_dispatcher_impl"),
    (_attention, "_disable_context_parallel_dispatcher_impl"),
    (_attention, "context_parallel_unshard"),
    (_load_balancer, "_HeadTailLoadBalancer"),
    (DTensor._op_dispatcher, "unwrap_to_op_info"),
    (DTensor._op_dispatcher, "wrap"),
    (DTensor._op_dispatcher.sharding_propagator, "propagate_op_sharding_non_cached"),
    (DTensor._op_dispatcher.sharding_propagator, "op_strategy_funcs"),
)
"""The private parts of torch's ring and of DTensor's dispatcher that this module calls."""


def check_torch_ring() -> None:
    """ConfigError, in one line, when this torch lacks the parts of its ring that cp uses."""
    missing = [name for module, name in TORCH_RING if not hasattr(module, name)]
    if missing:
        raise ConfigError(
            f"parallel.cp needs torch's ring attention, and torch {torch.__version__} lacks "
            f"{', '.join(missing)} (torch 2.11 to 2.14 have it); install one of those, or set "
            "parallel.cp=1"
        )


def ring_cpu_flash_attention() -> None:
    """Gives SDPA's CPU kernel, forward and backward, a handler in torch's ring: while torch's
    context parallel is on (it installs `_attention.custom_ops` then), DTensor hands the kernel's
    calls to `ring_on_cpu`. Idempotent."""
    _attention.custom_ops[CPU_FLASH] = ring_on_cpu
    _attention.custom_ops[CPU_FLASH_BACKWARD] = ring_on_cpu


def ring_on_cpu(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    """As torch's `_sdpa_handler` for the CUDA kernels: the local shards through the ring, the
    results DTensors split along the sequence as the inputs are."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    sharding = sequence_sharding(op_call, op_info.schema)
    if sharding.needs_redistribute:
        raise RuntimeError(f"{op_call} under cp takes inputs split along the sequence only")
    ring = ring_forward if op_call == CPU_FLASH else ring_backward
    group = op_info.compute_mesh.get_group()
    local = ring(group, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


def sequence_sharding(op_call: torch._ops.OpOverload, schema: OpSchema) -> OutputSharding:
    """DTensor's sharding of the op's outputs, by the rule that every tensor it takes and gives
    is split along the sequence. The rule is DTensor's only while this runs: registered for
    good, it would let the kernel run on such shards outside the ring, each attending to its own
    keys alone. Uncached, for the same reason (torch's CUDA rules leave theirs in the cache)."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.op_strategy_funcs[op_call] = split_along_sequence
    try:
        return propagator.propagate_op_sharding_non_cached(schema)
    finally:
        del propagator.op_strategy_funcs[op_call]


def split_along_sequence(op_schema: OpSchema) -> OpStrategy:
    outputs = len(op_schema.op._schema.returns)
    inputs = sum(isinstance(arg, OpStrategy) for arg in op_schema.args_schema)
    return expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(),
        op_schema,
        [[Shard(SEQUENCE_DIM)] * (outputs + inputs)],
        input_index=outputs,
    )


def ring_forward(
    group: torch.distributed.ProcessGroup,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """The CPU kernel's (output, logsumexp) of this rank's queries over every rank's keys."""
    if attn_mask is not None:  # `check_attention` refuses such models before any work
        raise NotImplementedError("ring attention takes is_causal, not an attn_mask")
    return _attention._templated_ring_attention(
        group,
        SEQUENCE_DIM,
        CPU_FLASH,
        query,
        key,
        value,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def ring_backward(
    group: torch.distributed.ProcessGroup,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """The gradients of this rank's query, key and value shards."""
    return _attention._templated_ring_attention_backward(
        group,
        SEQUENCE_DIM,
        CPU_FLASH_BACKWARD,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


@contextlib.contextmanager
def ring_attention(mesh: DeviceMesh) -> Iterator[None]:
    """While open, every `F.scaled_dot_product_attention` call runs as torch's load-balanced
    ring over `mesh` (1-D, the cp ranks), forward and backward, on CUDA or CPU: its query, key
    and value must be this rank's shards as `apply.shard_sequence` cuts them. torch's
    `context_parallel` without its buffers, which it shards for one block only: the loop's
    backward runs after `apply` returns, so the ring must outlive both."""
    ring_cpu_flash_attention()
    options = _attention._cp_options
    balanced = options.enable_load_balance
    options.enable_load_balance = True  # apply.shard_sequence's head-tail order
    _attention._enable_context_parallel_dispatcher_impl(seq_dim=SEQUENCE_DIM, mesh=mesh)
    try:
        yield
    finally:
        _attention._disable_context_parallel_dispatcher_impl()
        options.enable_load_balance = balanced
