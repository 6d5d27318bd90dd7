"""The tensor-parallel styles the template registers for transformers' GPT-2, whose config
declares none (`base_model_tp_plan`): registered by the class's dotted path, so nothing of
transformers is imported until a GPT-2 is split.

GPT-2's Linears are transformers' `Conv1D`, whose weight is nn.Linear's transposed ([in, out]):
a colwise split (`ColwiseConv1D`) takes dimension 1 of the weight and the bias, a rowwise one
(`RowwiseConv1D`) dimension 0 of the weight. Per block, as Megatron-LM splits it: the attention's
fused `c_attn` colwise (its q, k and v columns regrouped first, as the built-in GPT's qkv rows
are, so that each rank holds whole heads of each) and `c_proj` rowwise; the MLP's `c_fc` colwise
and `c_proj` rowwise. The attention then runs its rank's heads (`LocalHeads`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from src.parallel.tp.builtin_styles import qkv_order
from src.parallel.tp.registry import RowOrder, check_divides, tensor_parallel_styles

GPT2 = "transformers.models.gpt2.modeling_gpt2.GPT2PreTrainedModel"


class Conv1DStyle:
    """Mixed into torch's ColwiseParallel or RowwiseParallel: the style for a `Conv1D`, its
    weight and bias distributed as `placements` says, its inputs and outputs as the Linear's."""

    placements: dict[str, Placement]

    def _apply(self: Any, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
            for key, placement in self.placements.items():
                parameter = getattr(module, key)
                shards = distribute_tensor(
                    parameter, mesh, [placement], src_data_rank=self.src_data_rank
                )
                module.register_parameter(
                    key, nn.Parameter(shards, requires_grad=parameter.requires_grad)
                )

        return distribute_module(
            module,
            device_mesh,
            partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class ColwiseConv1D(Conv1DStyle, ColwiseParallel):
    """A Conv1D's output features split: its outputs' last dimension."""

    placements = {"weight": Shard(1), "bias": Shard(0)}


class RowwiseConv1D(Conv1DStyle, RowwiseParallel):
    """A Conv1D's input features split (its input's last dimension); the partial outputs summed,
    the bias added once."""

    placements = {"weight": Shard(0), "bias": Replicate()}
    desired_input_layouts = (Shard(-1),)


class LocalHeads(ParallelStyle):
    """A GPT2Attention that runs its rank's heads: it splits its `c_attn` output into q, k and v
    by `split_size` and reshapes each into heads of `head_dim`."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        module.num_heads //= tp
        module.split_size = module.embed_dim = module.embed_dim // tp
        return module


def gpt2_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return [(name, m) for name, m in model.named_modules() if isinstance(m, GPT2Block)]


def gpt2_row_orders(model: nn.Module, tp: int) -> dict[str, RowOrder]:
    """Each block's `c_attn` columns (its weight's dimension 1, its bias's 0) in `qkv_order`."""
    orders = {}
    for name, block in gpt2_blocks(model):
        order = qkv_order(block.attn.c_attn.nf, tp)
        orders[f"{name}.attn.c_attn.weight"] = RowOrder(order, dim=1)
        orders[f"{name}.attn.c_attn.bias"] = RowOrder(order)
    return orders


@tensor_parallel_styles(GPT2, row_orders=gpt2_row_orders)
def gpt2_styles(
    model: nn.Module, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    """Per block, its self-attention (heads split) and its MLP as Colwise/Rowwise pairs; the
    embeddings, norms, head (and a cross-attention) replicated."""
    check_divides(model.config.num_attention_heads, "num_attention_heads", tp)
    styles: dict[str, ParallelStyle] = {}
    for name, block in gpt2_blocks(model):
        check_divides(block.mlp.c_fc.nf, f"{name}'s MLP features", tp)
        styles[f"{name}.attn"] = LocalHeads()
        for part, up, down in (("attn", "c_attn", "c_proj"), ("mlp", "c_fc", "c_proj")):
            styles[f"{name}.{part}.{up}"] = ColwiseConv1D()
            styles[f"{name}.{part}.{down}"] = RowwiseConv1D()
    return styles
