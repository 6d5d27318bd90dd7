"""Optimizers and the learning-rate schedule, built from the unwrapped model's parameters."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from src.components.model_contract import blocks_of
from src.components.targets import check_arguments, import_target, settle_settings
from src.config.base import ConfigError
from src.config.optimizer import OWN_KEYS, OptimizerConfig

# Settings of `optimizer` that are the template's, not the optimizer class's.
TEMPLATE_KEYS = ("_target_", "_partial_", *OWN_KEYS)
# The key that marks the parameter group of the blocks' matrices (`block_matrices_apart`).
BLOCK_MATRICES = "block_matrices"


def build_optimizer(
    cfg: OptimizerConfig,
    params: Iterable[torch.nn.Parameter],
    block_matrices: Collection[torch.nn.Parameter] = (),
) -> torch.optim.Optimizer:
    """The optimizer that `optimizer._target_` names, over `params` in `parameter_groups`, with
    its settings (all but `OWN_KEYS`); a ConfigError if it does not import or does not take
    them. `block_matrices`: the whole model's (`block_matrices`), of which `params` (this
    process's) may hold some or none, grouped apart under `optimizer.block_matrices_apart`."""
    target = import_target(cfg._target_, "optimizer._target_")
    settings = {key: value for key, value in cfg.items() if key not in OWN_KEYS}
    given = [key for key in settings if key not in TEMPLATE_KEYS]
    check_arguments("optimizer", cfg._target_, target, given)
    return instantiate(settings, _convert_="all")(grouped(cfg, params, block_matrices))


def grouped(
    cfg: OptimizerConfig,
    params: Iterable[torch.nn.Parameter],
    block_matrices: Collection[torch.nn.Parameter],
) -> list[dict[str, Any]]:
    """`params` in `parameter_groups` as `cfg` asks: the blocks' matrices apart under
    `block_matrices_apart` (a ConfigError where the model's blocks hold none)."""
    if not cfg.get("block_matrices_apart"):  # a saved run's config from before it has none
        return parameter_groups(params, cfg.decay_1d)
    if not block_matrices:
        raise ConfigError(
            f"optimizer={cfg.name} steps the 2-D weight matrices of the model's blocks apart, "
            "and this model's blocks hold none (model.blocks names them); use optimizer=adamw"
        )
    return parameter_groups(params, cfg.decay_1d, {id(param) for param in block_matrices})


def block_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The 2-D parameters of `model`'s blocks (`blocks_of`): the weight matrices of its repeated
    layers, which Muon orthogonalises (the embeddings and head outside them are not; an
    nn.Sequential's children are all blocks, its head too)."""
    return [param for block in blocks_of(model) for param in block.parameters() if param.dim() == 2]


def settle_optimizer_settings(cfg: DictConfig) -> None:
    """`optimizer._target_` set to another class than its option's: the option's own settings
    that the new class does not take are left out (`settle_settings`)."""
    settle_settings(cfg, "optimizer", TEMPLATE_KEYS)


def parameter_groups(
    params: Iterable[torch.nn.Parameter], decay_1d: bool, apart: set[int] | None = None
) -> list[dict[str, Any]]:
    """One group of every parameter; without `decay_1d`, the matrices (2 or more dimensions:
    weights, embeddings) and then a group of the rest without weight decay. `apart` (the ids of
    the blocks' matrices): those first, in a group marked `block_matrices`. Each group keeps the
    parameters' order, and a group stays even when this process holds none of its parameters,
    so that every strategy and pipeline rank has single's groups."""
    params = list(params)
    if apart is not None:
        rest = [param for param in params if id(param) not in apart]
        matrices = [param for param in params if id(param) in apart]
        return [{"params": matrices, BLOCK_MATRICES: True}, *parameter_groups(rest, decay_1d)]
    if decay_1d:
        return [{"params": params}]
    return [
        {"params": [param for param in params if param.dim() >= 2]},
        {"params": [param for param in params if param.dim() < 2], "weight_decay": 0.0},
    ]


def adamw(
    params: list[dict[str, Any]], betas: Sequence[float], **settings: Any
) -> torch.optim.AdamW:
    """torch's AdamW over parameter groups, fused on GPUs (`on_cuda`)."""
    every = [param for group in params for param in group["params"]]
    return torch.optim.AdamW(params, betas=tuple(betas), fused=on_cuda(every) or None, **settings)


def on_cuda(params: list[torch.nn.Parameter]) -> bool:
    """Whether every parameter is on a GPU, where one fused kernel per step replaces AdamW's
    per-tensor (foreach) kernels; a CPU or meta model keeps torch's default."""
    return bool(params) and all(param.device.type == "cuda" for param in params)
