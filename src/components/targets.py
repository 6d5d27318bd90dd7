"""What the groups built by a `_target_` share (`model`, `optimizer`): the class or function it
names, the keyword arguments that takes, and, where the command line sets `_target_` to another
class than its option's, the option's own settings that the new class does not take left out
(`optimizer=sgd optimizer._target_=torch.optim.Adagrad` does not hand Adagrad SGD's
`momentum`)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from hydra.utils import _locate
from omegaconf import DictConfig, OmegaConf

from src.config.base import ConfigError, first_line


def import_target(name: str, setting: str) -> Any:
    """The class or function `name` (the value of `setting`, e.g. `model._target_`); a
    ConfigError if it does not import."""
    try:
        return _locate(name)  # Hydra's own lookup, which `instantiate` uses (`module.Class.method`)
    except Exception as error:  # noqa: BLE001 - Hydra wraps any import failure
        # Hydra's message spans lines; its cause says what failed in one.
        raise ConfigError(
            f"{setting}={name} does not import: {first_line(error.__cause__ or error)}"
        ) from None


def parameter_names(target: Any) -> set[str] | None:
    """The keyword arguments `target` takes by name; None where it takes any (`**kwargs`)."""
    parameters = inspect.signature(target).parameters.values()
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind != inspect.Parameter.VAR_POSITIONAL}


def missing_arguments(target: Any, given: Collection[str]) -> list[str]:
    """The arguments `target` needs (no default; passable by name) that `given` leaves out, in
    signature order."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [
        p.name
        for p in inspect.signature(target).parameters.values()
        if p.kind in named and p.default is inspect.Parameter.empty and p.name not in given
    ]


def check_arguments(group: str, name: str, target: Any, settings: Iterable[str]) -> set[str] | None:
    """The keyword arguments `target` (named `name`, built from `group`'s `settings`) takes, None
    where it takes any; a setting it does not take is a ConfigError naming it."""
    taken = parameter_names(target)
    if taken is not None:
        unknown = sorted(set(settings) - taken)
        if unknown:
            raise ConfigError(
                f"{group}: {name} takes no {unknown[0]!r}; it takes "
                f"{', '.join(sorted(taken)) or 'no settings'}"
            )
    return taken


def check_target(group: str, node: Mapping[str, Any], what: str) -> None:
    """`node._target_` (`group`'s, `what` by name: "a data builder") imports and takes every
    other setting of `node`: else one ConfigError line before any work, as for
    `model._target_`, rather than Hydra's error from the call."""
    name = node["_target_"]
    target = import_target(name, f"{group}._target_")
    try:
        check_arguments(group, name, target, [key for key in node if key != "_target_"])
    except ConfigError as error:
        raise ConfigError(
            f"{error}; {what} gets every setting of its {group} option: take them, or **settings"
        ) from None


def settle_settings(cfg: DictConfig, group: str, template_keys: Collection[str]) -> None:
    """`cfg[group]._target_` set to another class than its option's: the option's own settings
    (its schema's fields but `template_keys`) that the new class does not take are left out
    (once, where the job starts: its ranks get the settled config). The keys given beyond the
    option's (`+model.width=32`) all go to it."""
    node = cfg[group]
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema) or node._target_ == schema._target_:
        return
    taken = parameter_names(import_target(node._target_, f"{group}._target_"))
    if taken is None:
        return
    option_keys = {field.name for field in dataclasses.fields(schema)} - set(template_keys)
    left_out = option_keys - taken
    settings = OmegaConf.to_container(node)
    cfg[group] = OmegaConf.create({k: v for k, v in settings.items() if k not in left_out})
