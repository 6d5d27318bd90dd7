"""What every config group's schema shares: the error a bad setting raises, fixed choices, and
turning a composed config into typed objects or plain values."""

from __future__ import annotations

from enum import Enum
from typing import Any

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A setting that cannot work; raised before any process or run file is created.

    `train.py` prints its message as one line (no traceback) and exits with `exit_code`, so the
    message names the setting and what to change."""

    exit_code = 2


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, for a one-line report (empty if it has none)."""
    return "".join(str(error).strip().splitlines()[:1])


class Choice(str, Enum):
    """A setting with a fixed set of values: the schema refuses any other while Hydra composes
    the config, naming the values it takes. Members compare equal to their names, and print as
    them."""

    @staticmethod
    def _generate_next_value_(name: str, start: int, count: int, last_values: list) -> str:
        return name

    def __str__(self) -> str:
        return self.value


def choices(name: str, values: str, module: str) -> type[Choice]:
    """A `Choice` of the space-separated `values`, defined in `module` (the caller's `__name__`),
    where pickle finds it when a rank is started with it."""
    return Choice(name, values, module=module)


def check_given(cfg: DictConfig) -> None:
    """ConfigError, in one line, for the settings the chosen options leave without a value (`???`,
    e.g. `data=tokens`'s `data.path`): reading one later would raise in the middle of the run."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} must be given: the chosen options leave no value "
            f"({missing[0]}=...)"
        )


def typed(schema: type, node: Any) -> Any:
    """`node` (a composed config group, or a plain dict such as a launched rank's) as an object
    of its `schema` dataclass, which checks its ranges in `__post_init__`. Plain attributes: an
    OmegaConf lookup takes microseconds, and the loop makes several a step. A group's values
    that interpolate another group's (`trainer.eval_batch_size=${model.hidden}`) are resolved
    in their whole config first: the schema alone has no `model`."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """`cfg` resolved into plain values, each `Choice` as its name: what checkpoints (read with
    `weights_only`), W&B and the started ranks take."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
