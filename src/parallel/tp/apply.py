"""Tensor parallel applied: the styles a model is split by (`tp_styles`: its registered ones,
else the ones it declares), the split (`apply_tp`), the row orders that keep checkpoints in
single's layout, and what sequence and loss parallel check and run beside it.

A model's fused parameters (the transformer's qkv rows) are reordered before the split, so that
each rank's slice is its own share; `single_layout` undoes it for checkpoints, which keep
single's layout.
"""

from __future__ import annotations

import contextlib

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

import src.parallel.tp.builtin_styles  # noqa: F401  (registers the built-in models' styles)
import src.parallel.tp.gpt2_styles  # noqa: F401  (and transformers' GPT-2's)
from src.config.base import ConfigError
from src.parallel.base import LossFn, Tree
from src.parallel.tp.declared_styles import declared_style_names, declared_styles
from src.parallel.tp.registry import (
    REGISTERED,
    RowOrder,
    TensorParallelSpec,
    check_divides,
    class_path,
    no_row_orders,
    registered_names,
)

# What each option does, for the refusal of styles that do not take it.
OPTIONS = {
    "sequence_parallel": "splits each sequence of tokens over the tp ranks",
    "loss_parallel": "keeps the logits split over the vocabulary into the loss",
}


def registered_spec(model: nn.Module, tp: int) -> TensorParallelSpec:
    """The styles registered for `model`'s class or the nearest of its bases, else the ones the
    model declares (transformers' `_tp_plan`); ConfigError, in one line, when there are none."""
    for model_class in type(model).__mro__:
        for key in (model_class, class_path(model_class)):
            if key in REGISTERED:
                return REGISTERED[key]
    if declared_style_names(model):
        return TensorParallelSpec(declared_styles, no_row_orders, frozenset())
    raise ConfigError(
        f"parallel.tp={tp}: no tensor-parallel styles for {type(model).__name__} (registered: "
        f"{registered_names()}); a model brings its own with "
        "@tensor_parallel_styles (src/parallel/tp/registry.py, docs/strategies.md), or use "
        "parallel.tp=1"
    )


def check_options(model: nn.Module, spec: TensorParallelSpec, **chosen: bool) -> None:
    """ConfigError, in one line, for a chosen option that `model`'s styles do not take."""
    for option, on in chosen.items():
        if on and option not in spec.options:
            raise ConfigError(
                f"parallel.{option}=true (which {OPTIONS[option]}): the tensor-parallel styles "
                f"for {type(model).__name__} do not take it; set it to false (models whose styles "
                f"take it: {registered_names(option)})"
            )


def tp_styles(
    model: nn.Module, tp: int, sequence_parallel: bool = False, loss_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """Which submodule (by name) is split how, for `tp` ranks; ConfigError, in one line, for a
    model without styles, with sizes that do not divide by `tp`, or that cannot run the option."""
    spec = registered_spec(model, tp)
    check_options(model, spec, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    return spec.styles(model, tp, sequence_parallel, loss_parallel)


def checked_styles(
    model: nn.Module, inputs: Tree, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle] | None:
    """`tp_styles`, its options checked against `model` and its `inputs`; None without tensor
    parallel (`tp` 1), where the options are refused."""
    if tp == 1:
        if sequence_parallel or loss_parallel:
            raise ConfigError(
                "parallel.sequence_parallel and parallel.loss_parallel need tensor parallel; set "
                "parallel.tp to 2 or more"
            )
        return None
    styles = tp_styles(model, tp, sequence_parallel, loss_parallel)
    if sequence_parallel:
        check_sequence(inputs, tp)
    return styles


def check_beside_pipeline(sequence_parallel: bool, loss_parallel: bool) -> None:
    """ConfigError, in one line, for sequence or loss parallel under pp (not run yet)."""
    if sequence_parallel or loss_parallel:
        raise ConfigError(
            "parallel.sequence_parallel and parallel.loss_parallel do not run with "
            "parallel.pp > 1 yet; set them to false, or parallel.pp=1"
        )


def check_sequence(inputs: Tensor, tp: int) -> None:
    """Sequence parallel splits each sequence of tokens (dimension 1) over the tp ranks."""
    check_divides(inputs.shape[1], "tokens per sequence (data.seq_len)", tp)


def single_layout(name: str, tensor: Tensor, orders: dict[str, RowOrder]) -> Tensor:
    """`tensor` (the full value of state_dict key `name`) in single's row order."""
    if name not in orders:
        return tensor
    regrouped = orders[name]
    order = regrouped.order.to(tensor.device)
    return tensor.new_empty(tensor.shape).index_copy_(regrouped.dim, order, tensor)


def tp_layout(name: str, tensor: Tensor, orders: dict[str, RowOrder]) -> Tensor:
    """The inverse of `single_layout`: single's `tensor` in the row order `apply_tp` uses."""
    if name not in orders:
        return tensor
    return tensor.index_select(orders[name].dim, orders[name].order.to(tensor.device))


def apply_tp(
    model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False, loss_parallel: bool = False
) -> dict[str, RowOrder]:
    """Split `model` in place over the 1-D `mesh` by its styles; returns the row orders of its
    fused parameters (for `single_layout`)."""
    tp = mesh.size()
    styles = tp_styles(model, tp, sequence_parallel, loss_parallel)
    orders = registered_spec(model, tp).row_orders(model, tp)
    parameters = dict(model.named_parameters())
    for name in orders:
        parameters[name].data = tp_layout(name, parameters[name].data, orders)
    parallelize_module(model, mesh, styles)
    return orders


def split_vocabulary_loss(
    logits: DTensor, targets: Tensor, mesh: DeviceMesh, loss: LossFn
) -> Tensor:
    """Loss parallel's `loss` of `logits` split over the vocabulary (under torch's
    `loss_parallel` kernels): the targets, whole on every tp rank, become a replicated DTensor
    beside them, and the sums whole tensors again."""
    return loss(logits, DTensor.from_local(targets, mesh, [Replicate()])).full_tensor()


def loss_parallel_kernels(on: bool) -> contextlib.AbstractContextManager:
    """torch's cross-entropy kernels for logits split over the vocabulary, where loss parallel
    is `on` (to be entered for the forward and the backward)."""
    return torch_loss_parallel() if on else contextlib.nullcontext()
