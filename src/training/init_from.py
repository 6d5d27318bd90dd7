"""`trainer.init_from`: a new run that starts from the weights of another (a checkpoint, a run
folder, an exported `.pt`/`.safetensors` file, torchvision's ResNet weights): step 0, a fresh
optimizer, a new W&B run. The weights go into the plain model before the strategy wraps it, as a
full checkpoint's do, so every strategy starts from them."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from src.checkpoint.export import load_weights
from src.components.state_dicts import StateDictFit, check_weights_fit
from src.config.base import ConfigError

log = logging.getLogger(__name__)


def init_weights(
    model: nn.Module, path: Path, shapes_only: bool = False
) -> dict[str, torch.Tensor]:
    """The weights at `path` in `model`'s keys: a model that reads another codebase's state
    dicts renames their keys with its `from_foreign_keys` (ResNet: torchvision's)."""
    try:
        weights = load_weights(path, shapes_only)
    except ConfigError as error:
        raise ConfigError(
            f"trainer.init_from: {error}; give a checkpoint folder, a run folder, or a .pt or "
            ".safetensors weights file"
        ) from error
    rename = getattr(model, "from_foreign_keys", None)
    return rename(weights) if rename else weights


def check_init_weights(model: nn.Module, path: Path, strict: bool) -> None:
    """The weights at `path` fit `model` (on the meta device: keys and shapes only): every shape
    the same and, with `strict`, the same keys; else a ConfigError, one line."""
    check_weights_fit(
        model,
        init_weights(model, path, shapes_only=True),
        f"trainer.init_from: {path}",
        strict,
        keys_remedy="set trainer.init_strict=false to load the keys that fit and keep the others "
        "as initialised",
    )


def load_init_weights(model: nn.Module, path: Path, strict: bool, announce: bool) -> None:
    """Load the weights at `path` into the plain `model` (checked before: `check_init_weights`);
    without `strict`, the keys that fit, the model's others keeping their initialisation.
    `announce`: log what was loaded, and the keys left out (one line each)."""
    weights = init_weights(model, path)
    fit = StateDictFit.of(model.state_dict(), weights)
    unexpected = set(fit.unexpected)
    model.load_state_dict({k: v for k, v in weights.items() if k not in unexpected}, strict=strict)
    if not announce:
        return
    log.info("trainer.init_from: starting from the weights of %s", path)
    if fit.missing:
        log.warning(
            "trainer.init_from: %d keys of the model are not in %s and keep their "
            "initialisation: %s", len(fit.missing), path, ", ".join(fit.missing)
        )  # fmt: skip
    if fit.unexpected:
        log.warning(
            "trainer.init_from: %d keys of %s are not in the model and are left out: %s",
            len(fit.unexpected), path, ", ".join(fit.unexpected)
        )  # fmt: skip
