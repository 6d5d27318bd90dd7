"""What the template asks of a model: any `nn.Module`, built by its config's `_target_`, whose
`forward` takes the batch's inputs as one argument. What a strategy needs to know about it is
found here, in one place:

- its settings: the keys its config gives, `input_shape` and `num_classes` (the data's) only
  where its constructor names them (or takes `**kwargs`), and none of another option's keys
  (`model=mlp model._target_=mine.Net` does not hand `Net` the MLP's `hidden`);
- its blocks (`model_blocks`): the repeated modules that fsdp shards one by one, activation
  checkpointing and torch.compile prepare one by one, and pipelines cut between (any model
  but an nn.Sequential by torch's tracer: `src/parallel/pp/cut.py`). The
  members of `model.blocks` (a module's path, or class names); else an `nn.Sequential`'s
  children; else the runs of same-class members of the `ModuleList`s / `ModuleDict`s /
  `nn.Sequential`s inside the model, of the class with the most such members.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.components.targets import (
    check_arguments,
    import_target,
    missing_arguments,
    settle_settings,
)
from src.config.base import ConfigError

# Settings of `model` that are the template's, not the constructor's.
TEMPLATE_KEYS = ("_target_", "blocks")
# Where `declare_blocks` keeps the names on the model instance (not a module attribute: no
# state_dict key, no submodule; a deepcopy keeps it).
DECLARED = "_template_blocks"


def model_target(model_cfg: DictConfig | dict) -> Any:
    """The class or function `model._target_` names; a ConfigError if it does not import."""
    return import_target(model_cfg["_target_"], "model._target_")


def settle_model_settings(cfg: DictConfig) -> None:
    """`model._target_` set to another class than its option's: the option's own settings that
    the new class does not take are left out (`settle_settings`)."""
    settle_settings(cfg, "model", TEMPLATE_KEYS)


def model_arguments(
    model_cfg: DictConfig | dict, target: Any, input_shape: Sequence[int], num_classes: int
) -> dict:
    """The keyword arguments `target` (`model._target_`'s) is called with: its config's
    settings, and the data's `input_shape` and `num_classes` where it names them or takes any
    (`**kwargs`). A setting it does not take, or one it needs that is not given, is a
    ConfigError naming it."""
    plain = OmegaConf.to_container(model_cfg) if isinstance(model_cfg, DictConfig) else model_cfg
    settings = {k: v for k, v in plain.items() if k not in TEMPLATE_KEYS}
    taken = check_arguments("model", model_cfg["_target_"], target, settings)
    data = {"input_shape": tuple(input_shape), "num_classes": num_classes}
    # A constructor that takes **kwargs hands them on (a subclass's `**sizes` to its parent's).
    arguments = {**{k: v for k, v in data.items() if taken is None or k in taken}, **settings}
    check_given(model_cfg["_target_"], target, arguments)
    return arguments


def check_given(name: str, target: Any, arguments: dict) -> None:
    """Every argument `target` needs is in `arguments`: a missing one is refused in one line
    here, before any work, rather than as a TypeError from the constructor in training."""
    missing = missing_arguments(target, arguments)
    if missing:
        raise ConfigError(
            f"model: {name} needs {missing[0]!r}, which its config does not give: add "
            f"+model.{missing[0]}=<value>"
        )


def build_model(
    model_cfg: DictConfig | dict, input_shape: Sequence[int], num_classes: int
) -> nn.Module:
    """`model_cfg`'s model for data of `input_shape` and `num_classes`, its blocks declared."""
    target = model_target(model_cfg)
    model = target(**model_arguments(model_cfg, target, input_shape, num_classes))
    declare_blocks(model, model_cfg.get("blocks"))
    return model


def model_blocks(model: nn.Module, named: str | Sequence[str] | None = None) -> list[str]:
    """The names (as `named_modules` gives them) of `model`'s repeated blocks, in order: see the
    module's docstring. `named`: `model.blocks`, a module's path whose members are the blocks, or
    class names whose outermost instances are. [] where none are found."""
    if named:
        return named_blocks(model, named)
    if isinstance(model, nn.Sequential):
        return [name for name, _ in model.named_children()]
    runs: dict[type, list[str]] = {}  # by class: the members of its runs, in order
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            run = longest_same_class_run(module)
            if run:
                members = [f"{path}.{name}" if path else name for name in run]
                runs.setdefault(type(module.get_submodule(run[0])), []).extend(members)
    # The class with the most members (a ResNet's blocks over its four stages), the shallowest
    # of equals (a ModuleList's blocks before the Linears inside them).
    best = max(runs.values(), key=lambda names: (len(names), -names[0].count(".")), default=[])
    return best if len(best) > 1 else []


def longest_same_class_run(container: nn.Module) -> list[str]:
    """The names of the longest run of consecutive children of one class."""
    best: list[str] = []
    run: list[str] = []
    previous: type | None = None
    for name, child in container.named_children():
        run = [*run, name] if type(child) is previous else [name]
        previous = type(child)
        if len(run) > len(best):
            best = run
    return best


def named_blocks(model: nn.Module, named: str | Sequence[str]) -> list[str]:
    """`model.blocks`: a module's path (its children are the blocks) or a list of class names
    (their outermost instances are)."""
    if isinstance(named, str) and ("." in named or hasattr(model, named)):
        try:
            container = model.get_submodule(named)
        except AttributeError:
            raise ConfigError(f"model.blocks={named}: the model has no module {named!r}") from None
        return [f"{named}.{name}" for name, _ in container.named_children()]
    classes = {named} if isinstance(named, str) else set(named)
    found: list[str] = []
    for path, module in model.named_modules():
        inside = any(path.startswith(f"{outer}.") for outer in found)
        if type(module).__name__ in classes and not inside:
            found.append(path)
    if not found:
        raise ConfigError(
            f"model.blocks={named}: no module of the model is one of these classes, nor a "
            "module's path (e.g. model.blocks=model.layers)"
        )
    return found


def declare_blocks(model: nn.Module, named: str | Sequence[str] | None) -> None:
    """Settle `model`'s blocks once, where it is built (`model.blocks` or found), for every
    strategy that asks `blocks_of` later; a `model.blocks` naming nothing fails here."""
    model.__dict__[DECLARED] = tuple(model_blocks(model, named))


def block_names(model: nn.Module) -> list[str]:
    """The names of `model`'s blocks, as declared where it was built, else found."""
    declared = model.__dict__.get(DECLARED)
    return list(declared) if declared is not None else model_blocks(model)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """`model`'s blocks (`block_names`), the modules themselves."""
    return [model.get_submodule(name) for name in block_names(model)]
