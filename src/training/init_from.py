"""`trainer.init_from`: a new run that starts from the weights of another (a checkpoint, a run
folder, an exported `.pt`/`.safetensors` file, torchvision's ResNet weights, a transformers
folder or `hf:<hub name>`: GPT-2's for model=gpt): step 0, a fresh optimizer, a new W&B run. The
weights go into the plain model before the strategy wraps it, as a full checkpoint's do, so every
strategy starts from them."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from src.checkpoint.export import load_weights, transformers_config
from src.components.state_dicts import StateDictFit, check_weights_fit
from src.config.base import ConfigError

log = logging.getLogger(__name__)

HUB = "hf:"  # trainer.init_from=hf:<name>: a model on the Hugging Face hub


def init_from_path(setting: str) -> Path:
    """The weights `trainer.init_from` names: a path, or `hf:<name>`'s folder in the hub's cache
    (config.json and model.safetensors, downloaded there once)."""
    if not setting.startswith(HUB):
        return Path(setting).expanduser()
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(
            f"trainer.init_from={setting} needs huggingface_hub: pip install transformers"
        ) from None
    name = setting.removeprefix(HUB)
    try:
        folder = snapshot_download(name, allow_patterns=["*.json", "*.safetensors"])
    except Exception as error:  # noqa: BLE001 - offline, no such model, no access: one line
        reason = " ".join(str(error).split())
        raise ConfigError(
            f"trainer.init_from={setting}: the hub did not give {name} ({reason}); without "
            "network, give the folder its save_pretrained wrote"
        ) from error
    return Path(folder)


def init_weights(
    model: nn.Module, path: Path, shapes_only: bool = False
) -> dict[str, torch.Tensor]:
    """The weights at `path` in `model`'s keys: a model that reads another codebase's state
    dicts renames their keys with its `from_hf_format` (GPT: transformers' GPT-2, given its
    config.json where there is one) or `from_foreign_keys` (ResNet: torchvision's)."""
    try:
        weights = load_weights(path, shapes_only)
        config = transformers_config(path)
    except ConfigError as error:
        raise ConfigError(
            f"trainer.init_from: {error}; give a checkpoint folder, a run folder, a .pt or "
            ".safetensors weights file, or a transformers folder"
        ) from error
    read_hf = getattr(model, "from_hf_format", None)
    if read_hf is not None:
        try:
            weights = read_hf(weights, config)
        except ConfigError as error:
            raise ConfigError(f"trainer.init_from: {path} {error}") from error
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
