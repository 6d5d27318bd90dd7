"""Checkpoints: step-named folders that are complete or absent, read back to resume or export.

    checkpoints/step-000060/     one checkpoint, after optimizer step 60
        checkpoint.pt            `full` format: one `torch.save`d dict (below)
      or
        .metadata, __*_*.distcp  `sharded` format: torch.distributed.checkpoint (DCP) files that
        train_state.pt           every rank wrote in parallel (its own shards of `model` and
                                 `optimizer`), and the rest of the dict, written by rank 0
        manifest.json            every other file's size and crc32 (`integrity.py`), checked
                                 before a checkpoint is read (older checkpoints have none)

A full checkpoint is the dict `model` (the plain state_dict, single's keys, whatever the strategy),
`optimizer` (single's format: state keyed by parameter index), `step` (optimizer steps done),
`rng`, `config` (resolved), `tracker_run_ids` (each logger's run by the logger's name: W&B's,
MLflow's), `loss_scaling` (fp16's GradScaler state: the scale it reached, and the steps it
skipped), `model_args` (the `input_shape` and `num_classes` the model was built for),
`tied_keys` ({key: the key whose tensor it shares}) and `parameter_keys` (the model's parameters
in order); with trainer.ema_decay, `ema`, the weight average, in the format of an optimizer's
state (`src/training/ema.py`: state `ema` by parameter index); only tensors and plain values, so
it loads with `weights_only=True`. A sharded one holds the same, its `optimizer` and `ema` keyed
by parameter name; read whole (`load_checkpoint`), it comes back in the full format.

A checkpoint is written into `.staging-step-<N>/` and renamed to `step-<N>/` once every rank has
written its part (`writer.py`): a crash at any moment leaves the folder complete or absent. The
newest complete one is what `trainer.resume=auto` takes (the one before it when that cannot be
read, or its files are not the ones written); `trainer.keep_checkpoints` says how many are kept.

    checkpoints/best/            the checkpoint of trainer.monitor's best value so far (any
                                 format; its train state says its step), written the same way and
                                 swapped in for the previous best; never pruned, never resumed
                                 from by `auto`

    python -m src.checkpoint.store export <run dir or checkpoint> <model.safetensors or .pt>

writes the model's plain state_dict (single's keys) of any checkpoint, for inference elsewhere
(`src/checkpoint/export.py`).
"""

from __future__ import annotations

import functools
import logging
import runpy
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from src.checkpoint.integrity import check_manifest
from src.config.base import ConfigError, first_line
from src.runtime.run_folder import checkpoints_dir

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

log = logging.getLogger(__name__)

REQUIRED_KEYS = ("model", "optimizer", "step", "rng", "config")
FULL_FILE = "checkpoint.pt"
TRAIN_STATE_FILE = "train_state.pt"  # a sharded checkpoint's dict less model and optimizer
DCP_METADATA = ".metadata"
BEST = "best"  # the folder of trainer.monitor's best checkpoint


@runtime_checkable
class CheckpointedStrategy(Protocol):
    """What checkpointing calls on a strategy (`src/parallel/base.py` implements it)."""

    is_main: bool
    sharded_checkpoints: bool
    default_checkpoint_format: str

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]: ...

    def optimizer_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]: ...

    def sharded_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]: ...

    def barrier(self) -> None: ...


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{step:06d}"


def best_dir(run_dir: Path) -> Path:
    return checkpoints_dir(run_dir) / BEST


def staging_dir(final: Path) -> Path:
    return final.parent / f".staging-{final.name}"


def saved_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (staging folders start with a dot)."""
    folder = checkpoints_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.name.startswith("step-") and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder (`step-000042`) holds."""
    return int(path.name.removeprefix("step-"))


@functools.cache
def dcp_places_rows() -> bool:
    """Whether DCP saves and loads a tensor's pieces where its `CheckpointableTensor` attributes
    place them (`rows_placed`): torch 2.14 on. Before, it takes them for a whole tensor."""
    import torch.distributed.checkpoint as dcp  # slow to import; only sharded ones need it

    return hasattr(dcp, "CheckpointableTensor")


def rows_placed(
    local: torch.Tensor, rows: list[int], shape: torch.Size, dim: int, corner: Sequence[int]
) -> torch.Tensor:
    """`local`, whose row i along `dim` is row `rows[i]` of a tensor of `shape` (in the other
    dimensions it starts at `corner`, the piece's offsets), as DCP saves and loads a piece of
    that tensor (its `CheckpointableTensor` protocol): one chunk per run of consecutive rows. A
    view of `local`: what DCP loads into it lands in `local`."""
    view = local.detach()  # another tensor object on the same memory, to carry the attributes
    starts = [i for i in range(len(rows)) if i == 0 or rows[i] != rows[i - 1] + 1]
    ends = [*starts[1:], len(rows)]

    def at(row: int, others: Sequence[int]) -> tuple[int, ...]:
        return tuple(row if d == dim else other for d, other in enumerate(others))

    view.global_shape = tuple(shape)
    view.global_offsets = tuple(at(rows[start], corner) for start in starts)
    view.local_offsets = tuple(at(start, [0] * len(shape)) for start in starts)
    view.local_sizes = tuple(
        at(end - start, local.shape) for start, end in zip(starts, ends, strict=True)
    )
    return view


def resume_path(resume: str | None, run_dir: Path, announce: bool = False) -> Path | None:
    """The checkpoint `trainer.resume` names: None; `auto`, the run folder's newest checkpoint
    that can be read, if there is one yet (so a job can be restarted with the same command); or a
    path. With `announce`, says which damaged checkpoints `auto` passed over."""
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume).expanduser()
        check_manifest(path)  # what else is wrong with it, reading it says
        return path
    for path in reversed(saved_checkpoints(run_dir)):
        try:
            check_intact(path)
            return path
        except ConfigError as damaged:
            if announce:
                log.warning("%s; resuming from the checkpoint before it", damaged)
    return None


def check_intact(path: Path) -> None:
    """Raise ConfigError unless `path` reads as a checkpoint and, if sharded, every shard file
    its metadata names is there at its full length; with a manifest, every file is the one
    written (its size and checksum)."""
    check_manifest(path)
    load_checkpoint(path, mmap=True)
    if is_sharded(path):
        import torch.distributed.checkpoint as dcp

        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
        for info in storage.values():
            shard = path / info.relative_path
            if not shard.is_file() or shard.stat().st_size < info.offset + info.length:
                raise ConfigError(f"trainer.resume: {path} is missing part of {shard.name}")


def is_sharded(path: Path) -> bool:
    return (path / DCP_METADATA).is_file()


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint (a step folder, or a full checkpoint's file) in the full format; anything
    missing or unreadable is a ConfigError.

    `mmap=True` reads only the structure (shapes, step, config), for checks before any work: a
    sharded checkpoint's model then holds meta tensors and its optimizer is None."""
    if path.is_dir() and not is_sharded(path):
        path = path / FULL_FILE
    if path.is_dir():
        state = read_torch_file(path / TRAIN_STATE_FILE, mmap=False)
        if mmap:
            state["model"], state["optimizer"] = sharded_shapes(path), None
        else:
            state["model"], optimizers = read_sharded(path)
            state.update(optimizers)
        if "state_dict_keys" in state:  # older checkpoints: `in_block_order`'s order
            state["model"] = {key: state["model"][key] for key in state["state_dict_keys"]}
    else:
        state = read_torch_file(path, mmap)
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise ConfigError(
            f"trainer.resume: {path} is not a checkpoint written by train.py (it needs "
            f"{', '.join(REQUIRED_KEYS)}); point trainer.resume at a run's checkpoints/step-* "
            "folder"
        )
    return state


def read_torch_file(path: Path, mmap: bool) -> Any:
    if not path.is_file():
        raise ConfigError(
            f"trainer.resume: no checkpoint at {path}; give a checkpoint folder "
            "(checkpoints/step-*), or trainer.resume=auto with hydra.run.dir=<the run folder to "
            "continue>"
        )
    if not zipfile.is_zipfile(path):  # what torch.save writes; a truncated file is no zip
        raise ConfigError(
            f"trainer.resume: {path} is not a checkpoint, or it was cut short; point "
            "trainer.resume at an intact checkpoint, or leave it unset to start afresh"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - however it fails, the file is unusable
        raise unreadable(path, error) from error


def unreadable(path: Path, error: Exception) -> ConfigError:
    reason = first_line(error) or type(error).__name__
    return ConfigError(
        f"trainer.resume: {path} is not a readable checkpoint ({reason}); point "
        "trainer.resume at an intact checkpoint, or leave it unset to start afresh"
    )


def sharded_shapes(path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors as meta tensors of their full shapes, from the DCP metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # noqa: BLE001
        raise unreadable(path / DCP_METADATA, error) from error
    return {
        key.removeprefix("model."): meta_tensor(item)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }


def meta_tensor(item: TensorStorageMetadata) -> torch.Tensor:
    return torch.empty(item.size, dtype=item.properties.dtype, device="meta")


def read_sharded(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """A sharded checkpoint's model, and its optimizer states by key (`optimizer`, `ema`),
    whole, in this process alone (no process group); each optimizer state in single's format
    (keyed by parameter index)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        # What `format_utils.dcp_to_torch_save` does: the state rebuilt from the metadata.
        _load_state_dict(
            state,
            storage_reader=dcp.FileSystemReader(str(path)),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    except Exception as error:  # noqa: BLE001
        raise unreadable(path, error) from error
    model = state.pop("model")
    return in_block_order(model), {key: by_index(entry) for key, entry in state.items()}


def by_index(optimizer: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name as single's, keyed by parameter index."""
    names = [name for group in optimizer["param_groups"] for name in group["params"]]
    return renamed(optimizer, {name: i for i, name in enumerate(names)})


def in_block_order(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DCP lists each tensor where the first rank that wrote it put it: pipeline ranks holding
    blocks 0 and 2, and 1 and 3, list 0, 2, 1, 3. Back in block order (an `nn.Sequential`'s
    keys start with the block's index), each block's tensors in their own order."""

    def block(key: str) -> int:
        head = key.split(".", 1)[0]
        return int(head) if head.isdigit() else -1

    return dict(sorted(model_state.items(), key=lambda item: block(item[0])))


def renamed(state: dict[str, Any], new_key: dict) -> dict[str, Any]:
    """An optimizer state dict with its parameter keys (names or indices) mapped by `new_key`."""
    return {
        "state": {new_key[key]: value for key, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [new_key[key] for key in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    # Only a process that has used CUDA has GPU RNG states to keep: reading them initialises
    # CUDA in this process, which a CPU run on a GPU machine (the tests there) has no use for.
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def newest_checkpoint(source: Path) -> Path:
    """`source` itself when it is a checkpoint, else the newest of the run folder `source`."""
    if source.is_file() or (source / FULL_FILE).is_file() or is_sharded(source):
        return source
    saved = saved_checkpoints(source)
    if not saved:
        raise ConfigError(f"no checkpoint in {source}: give a run folder or a checkpoint folder")
    return saved[-1]


if __name__ == "__main__":
    # The export command lives in src/checkpoint/export.py, which imports this module (so this
    # one may not import it back): `python -m src.checkpoint.store export ...` runs it.
    runpy.run_module("src.checkpoint.export", run_name="__main__", alter_sys=True)
