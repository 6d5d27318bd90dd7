"""Tensor parallel: a model split in place by its registered plan (`apply_tp`), and the row
orders that keep checkpoints in single's layout.

A model's plan comes from the hook in src/parallel/tp_registry.py (the built-in models' from
src/parallel/tp_plans.py). A plan's fused parameters (the transformer's qkv rows) are reordered
before the split, so that each rank's slice is its own share; `single_layout` undoes it for
checkpoints, which keep single's layout.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

import src.parallel.tp_plans  # noqa: F401  (registers the built-in models' plans)
import src.parallel.tp_transformers  # noqa: F401  (and transformers' GPT-2's)
from src.parallel.tp_registry import RowOrder, check_divides, check_options, registered_spec


def tp_plan(
    model: nn.Module, tp: int, sequence_parallel: bool = False, loss_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """Which submodule (by name) is split how, for `tp` ranks; ConfigError, in one line, for a
    model without a plan, with sizes that do not divide by `tp`, or that cannot run the option."""
    spec = registered_spec(model, tp)
    check_options(model, spec, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    return spec.plan(model, tp, sequence_parallel, loss_parallel)


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
    """Split `model` in place over the 1-D `mesh` by its plan; returns the row orders of its
    fused parameters (for `single_layout`)."""
    tp = mesh.size()
    plan = tp_plan(model, tp, sequence_parallel, loss_parallel)
    orders = registered_spec(model, tp).row_orders(model, tp)
    parameters = dict(model.named_parameters())
    for name in orders:
        parameters[name].data = tp_layout(name, parameters[name].data, orders)
    parallelize_module(model, mesh, plan)
    return orders
