"""The built-in models' tensor-parallel (Megatron-style) styles, registered through the hook a
user's model uses (`registry.tensor_parallel_styles`).

Each model's styles pair a ColwiseParallel Linear (its output features split over the tp ranks)
with the RowwiseParallel Linear after it (its input features split; the partial outputs
all-reduced), so that activations between the two stay split and each pair costs one all-reduce
forward and one backward. What is not in a pair (embeddings, norms, the head of an odd MLP) is
replicated: every tp rank computes it whole from the same inputs, and gets the same gradient.

- mlp: its Linears in pairs (0 with 1, 2 with 3, ...).
- transformer, gpt: per block, attention (qkv colwise, heads split; proj rowwise) and the MLP
  (up colwise, down rowwise), as Megatron-LM and torchtitan do.

The fused qkv Linear's rows are (q, k, v) x heads; a plain colwise split would give rank 0 all of
q and half of k. Its row orders (`qkv_row_orders`) regroup them first, so that each rank's slice
holds the q, k and v rows of its own heads; the attention then runs the heads its slice holds.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from src.components.models import GPT, MLP, CausalSelfAttention, Transformer
from src.config.base import ConfigError
from src.parallel.tp.registry import RowOrder, check_divides, tensor_parallel_styles


@tensor_parallel_styles(MLP)
def linear_pairs_styles(
    model: nn.Module, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    styles: dict[str, ParallelStyle] = {}
    for (up, up_linear), (down, _) in zip(linears[::2], linears[1::2], strict=False):
        check_divides(up_linear.out_features, f"{up}'s output features", tp)
        styles[up], styles[down] = ColwiseParallel(), RowwiseParallel()
    return styles


def qkv_order(rows: int, tp: int) -> Tensor:
    """The order of a fused qkv output's `rows` that puts each of `tp` ranks' q, k and v rows
    next to each other: rows (3, tp, n) become (tp, 3, n)."""
    return torch.arange(rows).view(3, tp, rows // (3 * tp)).transpose(0, 1).reshape(-1)


def qkv_row_orders(model: nn.Module, tp: int) -> dict[str, RowOrder]:
    """For each fused qkv parameter (by state_dict key), its rows in `qkv_order`."""
    orders = {}
    for name, module in model.named_modules():
        if isinstance(module, CausalSelfAttention):
            order = RowOrder(qkv_order(module.qkv.out_features, tp))
            for parameter_name, _ in module.qkv.named_parameters():  # a bias-less qkv: weight
                orders[f"{name}.qkv.{parameter_name}"] = order
    return orders


@tensor_parallel_styles(
    Transformer, GPT, sequence_parallel=True, loss_parallel=True, row_orders=qkv_row_orders
)
def transformer_styles(
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
    styles: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        styles[embedding] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
        )
    for name in blocks:
        check_divides(model[int(name)].attention.heads, f"block {name}'s attention heads", tp)
        for norm, part, up, down in (
            ("norm1", "attention", "qkv", "proj"),
            ("norm2", "mlp", "0", "2"),
        ):
            if sequence_parallel:
                styles[f"{name}.{norm}"], styles[f"{name}.{part}"] = SequenceParallel(), gather
            styles[f"{name}.{part}.{up}"] = ColwiseParallel()
            styles[f"{name}.{part}.{down}"] = RowwiseParallel(output_layouts=between)
    if sequence_parallel:
        styles[f"{head}.0"] = SequenceParallel()
    if loss_parallel:
        styles[f"{head}.1"] = ColwiseParallel(
            input_layouts=between, output_layouts=Shard(-1), use_local_output=False
        )
    elif sequence_parallel:
        styles[f"{head}.1"] = gather
    return styles
