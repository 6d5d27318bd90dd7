"""timm's image models as the template's models (`model=timm model.name=resnet18`): any name
`timm.create_model` knows, for the data's channels and classes, with random weights or a local
weights file's. timm is optional: it is imported here, when such a model is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from src.components.data_contract import check_image_inputs
from src.config.base import ConfigError, first_line


def create(
    input_shape: Sequence[int],
    num_classes: int,
    name: str = "resnet18",
    sizes: dict[str, Any] | None = None,
    pretrained: str | None = None,
) -> nn.Module:
    """timm's `name` for images of `input_shape` (channels first) and `num_classes` classes;
    `sizes`: more keyword arguments of its constructor (img_size=32 for a ViT on CIFAR);
    `pretrained`: a local weights file (its head is replaced where its classes differ)."""
    check_image_inputs("model=timm", input_shape)
    try:
        import timm
    except ImportError:
        raise ConfigError("model=timm needs timm: pip install timm") from None
    if not timm.is_model(name):
        raise ConfigError(f"model.name={name}: timm has no such model (timm.list_models())")
    weights = None
    if pretrained is not None:
        weights = Path(pretrained).expanduser()
        if not weights.is_file():
            raise ConfigError(f"model.pretrained={pretrained}: no such weights file")
    loads = weights is not None and torch.get_default_device().type != "meta"
    overlay = {"pretrained_cfg_overlay": {"file": str(weights)}} if loads else {}
    try:
        return timm.create_model(
            name,
            pretrained=loads,
            num_classes=num_classes,
            in_chans=input_shape[0],
            **overlay,
            **(sizes or {}),
        )
    except (TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(f"model=timm model.name={name}: {first_line(error)}") from None
