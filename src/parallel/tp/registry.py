"""The hook through which a model brings its own tensor-parallel plan: torchtitan's
`ModelSpec.parallelize_fn`, for tensor parallel alone.

    @tensor_parallel_plan(MyModel)
    def my_model_plan(model, tp, sequence_parallel, loss_parallel):
        return {"1.up": ColwiseParallel(), "1.down": RowwiseParallel()}

A plan names which submodules are split how over `tp` ranks (torch's `parallelize_module`
plan); whatever it leaves out is replicated. It raises ConfigError, in one line, for a model it
cannot split (`check_divides`). `sequence_parallel` and `loss_parallel` reach it only if
registered as taken (`sequence_parallel=True`, `loss_parallel=True`); otherwise `tp_plan` refuses
them. `row_orders` is for fused parameters whose rows (slices along the dimension the plan
splits: a Linear's rows, a transposed weight's columns) a plain split would deal out wrongly (the
qkv Linear of src/parallel/tp/builtin_plans.py): `apply_tp` puts them in that order before the
split, and checkpoints undo it.

Plans are keyed by model class and found along its MRO, so a subclass of a planned model has
its parent's plan. Register where the model's class is defined: every process that builds the
model (each rank of `train.py`; `plan.py`) imports that module for Hydra's
`model._target_`, so the plan is there before `tp_plan` asks for it, with nothing to configure
or to send between processes. The built-in models' plans, in src/parallel/tp/builtin_plans.py,
are registered the same way; so is a library's class, by its dotted path (`module.ClassName`),
with nothing of the library imported until its model is split (src/parallel/tp/gpt2_plan.py).
A model without a registered plan may declare one as transformers' models do
(src/parallel/tp/declared_plans.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

from src.config.base import ConfigError

Plan = Callable[[nn.Module, int, bool, bool], dict[str, ParallelStyle]]


@dataclass(frozen=True)
class RowOrder:
    """A fused parameter's rows along `dim` in the order that puts each tp rank's share together:
    row i of the regrouped tensor is row `order[i]` of single's."""

    order: Tensor
    dim: int = 0


RowOrders = Callable[[nn.Module, int], dict[str, RowOrder]]


def no_row_orders(model: nn.Module, tp: int) -> dict[str, RowOrder]:
    """A model without fused parameters: every row stays where it is."""
    return {}


@dataclass(frozen=True)
class TensorParallelSpec:
    """One model class's tensor-parallel plan and what it takes."""

    plan: Plan
    row_orders: RowOrders
    options: frozenset[str]
    """Of `apply.OPTIONS`, the ones `plan` takes."""


# By model class, or a library's class by its dotted path (`class_path`).
REGISTERED: dict[type[nn.Module] | str, TensorParallelSpec] = {}


def class_path(model_class: type) -> str:
    return f"{model_class.__module__}.{model_class.__qualname__}"


def tensor_parallel_plan(
    *model_classes: type[nn.Module] | str,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    row_orders: RowOrders = no_row_orders,
) -> Callable[[Plan], Plan]:
    """Register the decorated function as the tensor-parallel plan of `model_classes` (classes,
    or dotted paths of classes)."""
    taken = {"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel}
    options = frozenset(option for option, on in taken.items() if on)

    def register(plan: Plan) -> Plan:
        for model_class in model_classes:
            REGISTERED[model_class] = TensorParallelSpec(plan, row_orders, options)
        return plan

    return register


def planned_names(option: str | None = None) -> str:
    """The planned model classes (those whose plans take `option`), by name: one name for a
    class imported under two module names, as a test's own model may be."""
    names = {
        kind.rpartition(".")[2] if isinstance(kind, str) else kind.__name__
        for kind, spec in REGISTERED.items()
        if option is None or option in spec.options
    }
    return ", ".join(sorted(names))


def check_divides(count: int, what: str, tp: int) -> None:
    """ConfigError, in one line, unless `tp` divides the model's `count` `what` (a plan's
    check on the sizes it splits)."""
    if count % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide the model's {count} {what}; choose a tp degree "
            "that divides them"
        )
