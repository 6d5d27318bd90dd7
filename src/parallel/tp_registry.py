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
qkv Linear of src/parallel/tp_plans.py): `apply_tp` puts them in that order before the split, and
checkpoints undo it.

Plans are keyed by model class and found along its MRO, so a subclass of a planned model has
its parent's plan. Register where the model's class is defined: every process that builds the
model (each rank of `train.py`; `plan.py`) imports that module for Hydra's
`model._target_`, so the plan is there before `tp_plan` asks for it, with nothing to configure
or to send between processes. The built-in models' plans, in src/parallel/tp_plans.py, are
registered the same way; so is a library's class, by its dotted path (`module.ClassName`), with
nothing of the library imported until its model is split.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from src.config.base import ConfigError

Plan = Callable[[nn.Module, int, bool, bool], dict[str, ParallelStyle]]

# What each option does, for the refusal of a plan that does not take it.
OPTIONS = {
    "sequence_parallel": "splits each sequence of tokens over the tp ranks",
    "loss_parallel": "keeps the logits split over the vocabulary into the loss",
}


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
    """Of `OPTIONS`, the ones `plan` takes."""


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


def registered_spec(model: nn.Module, tp: int) -> TensorParallelSpec:
    """The plan registered for `model`'s class or the nearest of its bases, else the plan the
    model declares (transformers' `_tp_plan`); ConfigError, in one line, when there is none."""
    for model_class in type(model).__mro__:
        for key in (model_class, class_path(model_class)):
            if key in REGISTERED:
                return REGISTERED[key]
    if declared_styles(model):
        return TensorParallelSpec(declared_plan, no_row_orders, frozenset())
    raise ConfigError(
        f"parallel.tp={tp}: no tensor-parallel plan for {type(model).__name__} (plans: "
        f"{planned_names()}); a model brings its own with "
        "@tensor_parallel_plan (src/parallel/tp_registry.py, docs/strategies.md), or use "
        "parallel.tp=1"
    )


def check_options(model: nn.Module, spec: TensorParallelSpec, **chosen: bool) -> None:
    """ConfigError, in one line, for a chosen option that `model`'s plan does not take."""
    for option, on in chosen.items():
        if on and option not in spec.options:
            raise ConfigError(
                f"parallel.{option}=true (which {OPTIONS[option]}): the tensor-parallel plan for "
                f"{type(model).__name__} does not take it; set it to false (plans that take it: "
                f"{planned_names(option)})"
            )


def check_divides(count: int, what: str, tp: int) -> None:
    """ConfigError, in one line, unless `tp` divides the model's `count` `what` (a plan's
    check on the sizes it splits)."""
    if count % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide the model's {count} {what}; choose a tp degree "
            "that divides them"
        )


# transformers' names for its tp plans' styles (`base_model_tp_plan`), as torch's ParallelStyles.
DECLARED_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}
# A model config's sizes that a tp split must divide (transformers' names).
SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads")


def declared_styles(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan a model declares as transformers' models do: module name
    patterns (`model.layers.*.self_attn.q_proj`) to style names; {} where it declares none."""
    plan = getattr(model, "_tp_plan", None)
    return dict(plan) if isinstance(plan, dict) else {}


def declared_plan(
    model: nn.Module, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    """`declared_styles` for the modules of `model` they name (`*` standing for one name)."""
    config = getattr(model, "config", None)
    for size in SPLIT_SIZES:
        if getattr(config, size, None):
            check_divides(getattr(config, size), size, tp)
    names = [name for name, _ in model.named_modules()]
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in declared_styles(model).items():
        if style not in DECLARED_STYLES:
            raise ConfigError(
                f"parallel.tp={tp}: {type(model).__name__}'s plan splits {pattern} as {style!r}, "
                f"which the template does not run (it runs {', '.join(DECLARED_STYLES)})"
            )
        matching = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        for name in filter(matching.match, names):
            plan[name] = DECLARED_STYLES[style]()
    return plan
