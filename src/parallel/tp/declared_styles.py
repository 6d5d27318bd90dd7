"""The tensor-parallel styles a model declares as transformers' models do (`base_model_tp_plan`,
as `model._tp_plan`): module name patterns to style names, turned into torch's ParallelStyles.
The styles of a model with none registered for its class (src/parallel/tp/registry.py)."""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from src.config.base import ConfigError
from src.parallel.tp.registry import check_divides

# transformers' names for its tp styles (`base_model_tp_plan`'s values), as torch's ParallelStyles.
DECLARED_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}
# A model config's sizes that a tp split must divide (transformers' names).
SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads")


def declared_style_names(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel styles a model declares as transformers' models do: module name
    patterns (`model.layers.*.self_attn.q_proj`) to style names; {} where it declares none."""
    declared = getattr(model, "_tp_plan", None)
    return dict(declared) if isinstance(declared, dict) else {}


def declared_styles(
    model: nn.Module, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    """`declared_style_names` for the modules of `model` they name (`*` standing for one name)."""
    config = getattr(model, "config", None)
    for size in SPLIT_SIZES:
        if getattr(config, size, None):
            check_divides(getattr(config, size), size, tp)
    names = [name for name, _ in model.named_modules()]
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in declared_style_names(model).items():
        if style not in DECLARED_STYLES:
            raise ConfigError(
                f"parallel.tp={tp}: {type(model).__name__}'s styles split {pattern} as {style!r}, "
                f"which the template does not run (it runs {', '.join(DECLARED_STYLES)})"
            )
        matching = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        for name in filter(matching.match, names):
            styles[name] = DECLARED_STYLES[style]()
    return styles
