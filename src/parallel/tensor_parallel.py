"""Tensor parallel (Megatron-style) plans for the project's models, and `apply_tp`.

Each plan pairs a ColwiseParallel Linear (its output features split over the tp ranks) with the
RowwiseParallel Linear after it (its input features split; the partial outputs all-reduced), so
that activations between the two stay split and each pair costs one all-reduce forward and one
backward. What is not in a pair (embeddings, norms, the head of an odd MLP) is replicated: every
tp rank computes it whole from the same inputs, and gets the same gradient.

- mlp: its Linears in pairs (0 with 1, 2 with 3, ...).
- transformer, gpt: per block, attention (qkv colwise, heads split; proj rowwise) and the MLP
  (up colwise, down rowwise), as Megatron-LM and torchtitan do.

The fused qkv Linear's rows are (q, k, v) x heads; a plain colwise split would give rank 0 all of
q and half of k. `apply_tp` therefore regroups the rows first, so that each rank's slice holds
the q, k and v rows of its own heads; `single_layout` undoes it for checkpoints, which keep
single's layout. The model code stays free of parallelism: the plan sets each attention's head
count to its rank's share.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from src.components.models import GPT, MLP, CausalSelfAttention, Transformer
from src.config.base import ConfigError

PLANNED = (MLP, Transformer, GPT)


def tp_plan(
    model: nn.Module, tp: int, sequence_parallel: bool = False, loss_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """Which submodule (by name) is split how, for `tp` ranks; ConfigError, in one line, for a
    model without a plan, with sizes that do not divide by `tp`, or that cannot run the option."""
    if not isinstance(model, PLANNED):
        raise ConfigError(
            f"parallel.tp={tp}: no tensor-parallel plan for {type(model).__name__} (plans: "
            f"{', '.join(kind.__name__ for kind in PLANNED)}, in src/parallel/"
            "tensor_parallel.py); use parallel.tp=1"
        )
    if isinstance(model, MLP):
        if sequence_parallel or loss_parallel:
            raise ConfigError(
                "parallel.sequence_parallel and parallel.loss_parallel split a sequence of tokens "
                "and a language model's vocabulary: use them with model=transformer or gpt"
            )
        return linear_pairs_plan(model, tp)
    return transformer_plan(model, tp, sequence_parallel, loss_parallel)


def linear_pairs_plan(model: nn.Module, tp: int) -> dict[str, ParallelStyle]:
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    plan: dict[str, ParallelStyle] = {}
    for (up, up_linear), (down, _) in zip(linears[::2], linears[1::2], strict=False):
        check_divides(up_linear.out_features, f"{up}'s output features", tp)
        plan[up], plan[down] = ColwiseParallel(), RowwiseParallel()
    return plan


def transformer_plan(
    model: nn.Sequential, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    """Megatron's blocks. With `sequence_parallel` the residual stream between them is split
    along the sequence (Shard(1)): the norms run on each rank's tokens, each block's input is
    all-gathered and its output reduce-scattered (together the traffic of one all-reduce). With
    `loss_parallel` the head's logits stay split over the vocabulary, into the loss."""
    embedding, *blocks, head = (str(index) for index in range(len(model)))
    if loss_parallel and model[-1][1].weight is model[0].token.weight:
        raise ConfigError(
            "parallel.loss_parallel splits the vocabulary head's weight, which this model ties to "
            "the token embedding; set model.tie_weights=false"
        )
    between = Shard(1) if sequence_parallel else Replicate()
    gather = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
    )
    plan: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        plan[embedding] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
        )
    for name in blocks:
        check_divides(model[int(name)].attention.heads, f"block {name}'s attention heads", tp)
        for norm, part, up, down in (
            ("norm1", "attention", "qkv", "proj"),
            ("norm2", "mlp", "0", "2"),
        ):
            if sequence_parallel:
                plan[f"{name}.{norm}"], plan[f"{name}.{part}"] = SequenceParallel(), gather
            plan[f"{name}.{part}.{up}"] = ColwiseParallel()
            plan[f"{name}.{part}.{down}"] = RowwiseParallel(output_layouts=between)
    if sequence_parallel:
        plan[f"{head}.0"] = SequenceParallel()
    if loss_parallel:
        plan[f"{head}.1"] = ColwiseParallel(
            input_layouts=between, output_layouts=Shard(-1), use_local_output=False
        )
    elif sequence_parallel:
        plan[f"{head}.1"] = gather
    return plan


def check_sequence(inputs: Tensor, tp: int) -> None:
    """Sequence parallel splits each sequence of tokens (dimension 1) over the tp ranks."""
    check_divides(inputs.shape[1], "tokens per sequence (data.seq_len)", tp)


def check_divides(count: int, what: str, tp: int) -> None:
    if count % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide the model's {count} {what}; choose a tp degree "
            "that divides them"
        )


def qkv_row_orders(model: nn.Module, tp: int) -> dict[str, Tensor]:
    """For each fused qkv parameter (by state_dict key), the order of its rows that puts each tp
    rank's q, k and v rows next to each other: rows (3, tp, n) become (tp, 3, n)."""

    orders = {}
    for name, module in model.named_modules():
        if isinstance(module, CausalSelfAttention):
            rows = module.qkv.out_features
            order = torch.arange(rows).view(3, tp, rows // (3 * tp)).transpose(0, 1).reshape(-1)
            orders[f"{name}.qkv.weight"] = orders[f"{name}.qkv.bias"] = order
    return orders


def single_layout(name: str, tensor: Tensor, orders: dict[str, Tensor]) -> Tensor:
    """`tensor` (the full value of state_dict key `name`) in single's row order."""
    if name not in orders:
        return tensor
    restored = tensor.new_empty(tensor.shape)
    restored[orders[name]] = tensor
    return restored


def tp_layout(name: str, tensor: Tensor, orders: dict[str, Tensor]) -> Tensor:
    """The inverse of `single_layout`: single's `tensor` in the row order `apply_tp` uses."""
    return tensor[orders[name]] if name in orders else tensor


def apply_tp(
    model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False, loss_parallel: bool = False
) -> dict[str, Tensor]:
    """Split `model` in place over the 1-D `mesh` by its plan; returns the qkv row orders (for
    `single_layout`)."""
    tp = mesh.size()
    plan = tp_plan(model, tp, sequence_parallel, loss_parallel)
    orders = qkv_row_orders(model, tp)
    parameters = dict(model.named_parameters())
    for name, order in orders.items():
        parameters[name].data = parameters[name].data[order]
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.heads //= tp
    parallelize_module(model, mesh, plan)
    return orders
