"""The hook through which a model brings its own tensor-parallel styles: torchtitan's
`ModelSpec.parallelize_fn`, for tensor parallel alone.

    @tensor_parallel_styles(MyModel)
    def my_model_styles(model, tp, sequence_parallel, loss_parallel):
        return {"1.up": ColwiseParallel(), "1.down": RowwiseParallel()}

A model's styles name which submodules are split how over `tp` ranks (what torch's
`parallelize_module` takes as its `parallelize_plan`: module names to ParallelStyles); whatever
they leave out is replicated. The function raises ConfigError, in one line, for a model it
cannot split (`check_divides`). `sequence_parallel` and `loss_parallel` reach it only if
registered as taken (`sequence_parallel=True`, `loss_parallel=True`); otherwise `tp_styles`
refuses them. `row_orders` is for fused parameters whose rows (slices along the dimension the
styles split: a Linear's rows, a transposed weight's columns) a plain split would deal out
wrongly (the qkv Linear of src/parallel/tp/builtin_styles.py): `apply_tp` puts them in that
order before the split, and checkpoints undo it.

Styles are keyed by model class and found along its MRO, so a subclass of a registered model
has its parent's styles. Register where the model's class is defined: every process that builds
the model (each rank of `train.py`; `plan.py`) imports that module for Hydra's
`model._target_`, so the styles are there before `tp_styles` asks for them, with nothing to
configure or to send between processes. The built-in models' styles, in
src/parallel/tp/builtin_styles.py, are registered the same way; so is a library's class, by its
dotted path (`module.ClassName`), with nothing of the library imported until its model is split
(src/parallel/tp/gpt2_styles.py). A model without registered styles may declare them as
transformers' models do (src/parallel/tp/declared_styles.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

from src.config.base import ConfigError

StylesFn = Callable[[nn.Module, int, bool, bool], dict[str, ParallelStyle]]
"""A model's styles for `tp` ranks, sequence parallel and loss parallel."""


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
    """One model class's tensor-parallel styles and what they take."""

    styles: StylesFn
    row_orders: RowOrders
    options: frozenset[str]
    """Of `apply.OPTIONS`, the ones `styles` takes."""


# By model class, or a library's class by its dotted path (`class_path`).
REGISTERED: dict[type[nn.Module] | str, TensorParallelSpec] = {}


def class_path(model_class: type) -> str:
    return f"{model_class.__module__}.{model_class.__qualname__}"


def tensor_parallel_styles(
    *model_classes: type[nn.Module] | str,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    row_orders: RowOrders = no_row_orders,
) -> Callable[[StylesFn], StylesFn]:
    """Register the decorated function as the tensor-parallel styles of `model_classes`
    (classes, or dotted paths of classes)."""
    taken = {"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel}
    options = frozenset(option for option, on in taken.items() if on)

    def register(styles: StylesFn) -> StylesFn:
        for model_class in model_classes:
            REGISTERED[model_class] = TensorParallelSpec(styles, row_orders, options)
        return styles

    return register


def registered_names(option: str | None = None) -> str:
    """The registered model classes (those whose styles take `option`), by name: one name for a
    class imported under two module names, as a test's own model may be."""
    names = {
        kind.rpartition(".")[2] if isinstance(kind, str) else kind.__name__
        for kind, spec in REGISTERED.items()
        if option is None or option in spec.options
    }
    return ", ".join(sorted(names))


def check_divides(count: int, what: str, tp: int) -> None:
    """ConfigError, in one line, unless `tp` divides the model's `count` `what` (a styles
    function's check on the sizes it splits)."""
    if count % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide the model's {count} {what}; choose a tp degree "
            "that divides them"
        )
