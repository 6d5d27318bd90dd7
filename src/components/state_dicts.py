"""State dicts compared with a model's (which keys and shapes fit), and a model's tied weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from src.config.base import ConfigError


@dataclass
class StateDictFit:
    """How a given state dict fits the one a model expects: the keys it lacks, the keys the model
    does not have, and the keys of both whose shapes differ."""

    missing: list[str]
    unexpected: list[str]
    other_shape: list[tuple[str, list[int], list[int]]]  # (key, given shape, expected shape)

    @classmethod
    def of(cls, expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> StateDictFit:
        return cls(
            missing=[key for key in expected if key not in given],
            unexpected=[key for key in given if key not in expected],
            other_shape=[
                (key, list(given[key].shape), list(value.shape))
                for key, value in expected.items()
                if key in given and given[key].shape != value.shape
            ],
        )

    def shape_problem(self) -> str:
        """The first key whose shapes differ, with both shapes, and how many do; or ''."""
        if not self.other_shape:
            return ""
        key, given, expected = self.other_shape[0]
        return (
            f"{len(self.other_shape)} shapes differ (first {key}: {given} in the file, "
            f"{expected} here)"
        )

    def key_problems(self) -> list[str]:
        """The keys missing and the keys the model does not have (the first of each)."""
        problems = []
        if self.missing:
            problems.append(f"{len(self.missing)} keys missing (first {self.missing[0]})")
        if self.unexpected:
            problems.append(
                f"{len(self.unexpected)} keys it does not have (first {self.unexpected[0]})"
            )
        return problems

    def problems(self) -> str:
        """What keeps the state dict from loading strictly (the first of each kind), or ''."""
        return "; ".join([*self.key_problems(), *filter(None, [self.shape_problem()])])


def check_weights_fit(
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    source: str,
    strict: bool = True,
    shapes_remedy: str = "",
    keys_remedy: str = "",
) -> None:
    """`weights` (from `source`: the setting and its path, as the error names them) fit `model`:
    every shape the same and, with `strict`, the same keys; else a ConfigError, one line, that
    ends with the remedy for what differs."""
    fit = StateDictFit.of(model.state_dict(), weights)
    if fit.other_shape:
        problems, remedy = [fit.shape_problem()], shapes_remedy
    else:
        problems, remedy = fit.key_problems() if strict else [], keys_remedy
    if problems:
        advice = f"; {remedy}" if remedy else ""
        raise ConfigError(f"{source} does not fit this model: {'; '.join(problems)}{advice}")


def tied_keys(model: nn.Module) -> dict[str, str]:
    """{key: the key it is tied to} for each parameter the model holds under a second name (GPT's
    head weight is its token embedding's), the first name being the one it is tied to."""
    first_name: dict[int, str] = {}
    tied = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first_name:
            tied[name] = first_name[id(parameter)]
        else:
            first_name[id(parameter)] = name
    return tied


def tie_again(model: nn.Module, tied: dict[str, str]) -> None:
    """Tie `tied`'s parameters again (`tied_keys`'s record, taken before) once
    `load_state_dict(assign=True)` has given each key a tensor of its own."""
    for key, first in tied.items():
        owner, _, name = key.rpartition(".")
        setattr(model.get_submodule(owner), name, model.get_parameter(first))
