"""The strategy classes, each in a module of its own: `single`, `dp`, `dp_criterion`,
`model_parallel`, `replicated.Replicated` for dp_replicate alone (ddp, hybrid) and `mesh.Mesh` for
every other layout of one process per rank, whose presets (fsdp, tp, pp, cp, fsdp_tp, fsdp_cp_tp,
fsdp_tp_pp, ep, mesh) set its degrees. Each degree's mechanism has a module of its own:
`dp_replicate/` (DDP's), `dp_shard/` (FSDP2 over the
data-parallel dimensions), `hybrid.py` (the in-process stage cut), `tp/` (tp),
`cp/` (cp), `pp/` (pp). `build_strategy` imports only the
class asked for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from src.config.base import typed
from src.config.parallel import MeshConfig, ParallelConfig
from src.parallel.base import ConfigError, Strategy

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
REPLICATED, MESH = "src.parallel.replicated.Replicated", "src.parallel.mesh.Mesh"
LAYOUT_CLASSES = (REPLICATED, MESH)


def layout_class(settings: MeshConfig) -> str:
    """`Replicated` for dp_replicate alone (`ddp`, `hybrid`, or `tp` of one rank beside it),
    `Mesh` for any other layout."""
    replicas_only = settings.dp_shard == settings.tp == settings.pp == settings.cp == 1
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
