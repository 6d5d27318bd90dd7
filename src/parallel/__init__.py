"""Parallelism: a folder per degree, each holding how it is applied and what it costs
(`dp_replicate/`, `dp_shard/`, `tp/`, `cp/`, `pp/`, `ep/`, and the in-process `replicas/` and
`stages/`), and `strategies/`, the classes that compose them behind the loop's interface
(`base.py`). `build_strategy` makes the class `parallel._target_` names, importing only it:
`replicated.Replicated` for dp_replicate alone (ddp, hybrid), `mesh.Mesh` for every other
layout of one process per rank (fsdp, tp, pp, cp, fsdp_tp, fsdp_cp_tp, fsdp_tp_pp, ep, mesh)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from src.config.base import typed
from src.config.parallel import MeshConfig, ParallelConfig
from src.parallel.base import ConfigError, Strategy
from src.parallel.layout import DIMENSIONS

if TYPE_CHECKING:
    from src.runtime.ranks import Ranks


def build_strategy(
    cfg: ParallelConfig | DictConfig,
    device_type: str,
    precision: str = "fp32",
    ranks: Ranks | None = None,
) -> Strategy:
    """The strategy class that `parallel._target_` names, given `cfg` as its schema's object
    (which checks the ranges of its settings; the strategy checks how they go together; nothing
    is started yet). `precision` is `trainer.precision`, for strategies that keep
    parameters in it (fsdp); `ranks`, the ranks torchrun, srun or `launch` started, this process
    among them (None: it is the only one), for `setup` to join."""
    kind = strategy_class(cfg._target_)
    settings = cfg if isinstance(cfg, kind.settings_schema) else typed(kind.settings_schema, cfg)
    if cfg._target_ in LAYOUT_CLASSES:
        kind = strategy_class(layout_class(settings))
    return kind(settings, device_type, precision, ranks)


# The classes of one process per rank, whichever of them a preset names: its degrees as set
# (-1 among them) choose. DDP alone is not a mesh: no DeviceMesh, no DTensors.
REPLICATED, MESH = (
    "src.parallel.strategies.replicated.Replicated",
    "src.parallel.strategies.mesh.Mesh",
)
LAYOUT_CLASSES = (REPLICATED, MESH)


def layout_class(settings: MeshConfig) -> str:
    """`Replicated` for dp_replicate alone (`ddp`, `hybrid`, or `tp` of one rank beside it),
    `Mesh` for any other layout."""
    others = (name for name in DIMENSIONS if name != "dp_replicate")
    replicas_only = all(getattr(settings, name) == 1 for name in others)
    return REPLICATED if replicas_only else MESH


def strategy_class(target: str) -> type[Strategy]:
    """The class at `target` (`module.Class`). Not Hydra's `instantiate`, which would spread the
    settings into keyword arguments: a strategy keeps them whole, as `self.cfg`."""
    module_name, _, class_name = target.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"parallel._target_={target} names no class: {error}") from None
    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise ConfigError(f"parallel._target_={target} is not a Strategy (see src/parallel/)")
    return found
