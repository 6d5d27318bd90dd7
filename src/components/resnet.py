"""torchvision's ResNet as an `nn.Sequential` of stem, stages and head.

Built from torchvision's own residual blocks (`BasicBlock`, `Bottleneck`), initialised as
torchvision initialises them, so that with `width=64` and the standard stem it computes exactly
what `torchvision.models.resnet18(num_classes=...)` computes: its state_dict loads here, key for
key (`load_weights`). The six blocks [stem, stage 1..4, head] are what a pipeline cuts and what
fsdp shards one by one. This module is imported only through `model=resnet` (`_target_`), so the
rest of the template runs without torchvision.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, conv1x1

from src.components.state_dicts import StateDictFit

ARCHS: dict[str, tuple[type[BasicBlock | Bottleneck], list[int]]] = {
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet34": (BasicBlock, [3, 4, 6, 3]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
}
# torchvision's state_dict keys -> ours: conv1/bn1 are the stem's 0/1, layerN is block N, fc the
# head's 2.
TORCHVISION_KEYS = [(r"^conv1\.", "0.0."), (r"^bn1\.", "0.1."), (r"^layer(\d)\.", r"\1."),
                    (r"^fc\.", "5.2.")]  # fmt: skip


def stem(channels: int, width: int, cifar_stem: bool) -> nn.Sequential:
    """ImageNet's 7x7/2 convolution and 3x3/2 max-pool (downsampling by 4), or for 32x32 inputs
    a 3x3/1 convolution and no pool."""
    if cifar_stem:
        return nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
    return nn.Sequential(
        nn.Conv2d(channels, width, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    )


def stage(
    block: type[BasicBlock | Bottleneck], width_in: int, planes: int, count: int, stride: int
) -> nn.Sequential:
    """`count` residual blocks, the first changing the width (and the stride), as torchvision's
    `ResNet._make_layer` lays them out."""
    width_out = planes * block.expansion
    downsample = None
    if stride != 1 or width_in != width_out:
        downsample = nn.Sequential(conv1x1(width_in, width_out, stride), nn.BatchNorm2d(width_out))
    blocks = [block(width_in, planes, stride, downsample)]
    blocks += [block(width_out, planes) for _ in range(count - 1)]
    return nn.Sequential(*blocks)


def downsampling(cifar_stem: bool) -> int:
    """How much the stem and stages shrink the height and width: 8, or 32 with ImageNet's stem."""
    return 8 if cifar_stem else 32


class ResNet(nn.Sequential):
    """torchvision's ResNet (`arch` resnet18, resnet34 or resnet50) with stage widths `width`,
    2, 4 and 8 times it (torchvision's: 64), as blocks [stem, stage 1..4, head]. Input (batch,
    channels, height, width); output (batch, classes). `weights`: a local state_dict file, in
    this model's keys or torchvision's."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        arch: str,
        width: int,
        cifar_stem: bool,
        weights: str | None = None,
    ):
        if arch not in ARCHS:
            raise ValueError(f"model.arch={arch} is not one of {', '.join(ARCHS)}")
        if len(input_shape) != 3:
            raise ValueError(
                f"model=resnet needs image-shaped input (channels, height, width), got "
                f"{list(input_shape)}; use an image set such as data=cifar10"
            )
        channels, height, width_px = input_shape
        factor = downsampling(cifar_stem)
        if min(height, width_px) < factor:
            hint = "" if cifar_stem else " or set model.cifar_stem=true (downsamples by 8)"
            raise ValueError(
                f"model=resnet downsamples by {factor}, so its {height}x{width_px} inputs would "
                f"shrink below one pixel; use images of at least {factor}x{factor}{hint}"
            )
        block, counts = ARCHS[arch]
        widths = [width * 2**i for i in range(4)]
        stages, width_in = [], width
        for i, (planes, count) in enumerate(zip(widths, counts, strict=True)):
            stages.append(stage(block, width_in, planes, count, stride=1 if i == 0 else 2))
            width_in = planes * block.expansion
        head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width_in, num_classes)
        )
        super().__init__(stem(channels, width, cifar_stem), *stages, head)
        self.reset_parameters()
        if weights is not None:
            load_weights(self, weights)

    @staticmethod
    def from_foreign_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state_dict of torchvision's ResNet in this model's keys (`trainer.init_from`)."""
        return from_torchvision_keys(state)

    def reset_parameters(self) -> None:
        """torchvision's initialisation (its ResNet's, after the layers' own)."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)


def from_torchvision_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A torchvision ResNet state_dict in this model's keys (others pass unchanged)."""
    renamed = {}
    for key, value in state.items():
        for pattern, replacement in TORCHVISION_KEYS:
            key = re.sub(pattern, replacement, key)
        renamed[key] = value
    return renamed


def load_weights(model: nn.Module, path: str) -> None:
    """Load a local state_dict file (ours or torchvision's keys) into `model`, every key; a model
    on the meta device (the checks before training) only has the keys and shapes checked."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"model.weights={path}: no such file")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 - pickle, zip and torch errors alike
        raise ValueError(
            f"model.weights={path} is not a state_dict torch can read ({error})"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # one of train.py's checkpoints
    state = from_torchvision_keys(state)
    problem = StateDictFit.of(model.state_dict(), state).problems()
    if problem:
        raise ValueError(f"model.weights={path} does not fit this model: {problem}")
    device = next(model.parameters()).device
    model.load_state_dict({key: value.to(device) for key, value in state.items()})
