"""A model's weights outside the run: exported files, and what starts a run from them.

    python -m src.checkpoint.store export <run dir or checkpoint> model.safetensors   (or .pt)

writes the plain state_dict (single's keys) of a run's newest checkpoint, or of the checkpoint
folder given, full or sharded: the weights the run evaluated (its weight average under
trainer.ema_eval). The suffix picks the format: `.safetensors` (the `safetensors`
package's format: no pickle, memory-mappable) holds the tensors, tied ones once, and in its
metadata the model's config as JSON strings: `model` (the resolved model group), `input_shape`
and `num_classes` (what the model was built for: `instantiate(model, input_shape=...,
num_classes=...)` rebuilds it), `state_dict_keys` (the keys in order) and `tied_keys` ({key: the
key it shares its tensor with}). Any other suffix gets `torch.save` of the state_dict (a pickle;
`torch.load(..., weights_only=True)` reads it). A target without a suffix (or `--format hf`) is a
folder in the Hugging Face format (config.json + model.safetensors, `save_pretrained`'s), which
`from_pretrained` loads, for a model that has one: transformers' models (`model=hf_causal_lm`)
their own, `gpt` and `gpt2_124m` GPT-2's (`GPT2LMHeadModel`: `components/gpt2_format.py`); the
run's tokenizer (`<run>/tokenizer/`), if it saved one, goes beside them as `AutoTokenizer` reads
it (`tokenizer.save_for_transformers`: tiktoken's converted to transformers').

`load_weights` reads the plain state_dict back from any of these (a run dir, a checkpoint, a
`.pt` or `.safetensors` file, a transformers folder), `weights_config` the model config it was
saved with.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from src.checkpoint.integrity import check_manifest
from src.checkpoint.store import load_checkpoint, newest_checkpoint, read_torch_file
from src.components.averaged_weights import EMA_KEY
from src.components.model_contract import build_model
from src.components.state_dicts import tie_again, tied_keys
from src.components.tokenizer import save_for_transformers
from src.config.base import ConfigError
from src.runtime.files import readable_as_umask_allows, write_atomically
from src.runtime.run_folder import CHECKPOINTS, tokenizer_dir

SAFETENSORS = ".safetensors"
HF_CONFIG, HF_WEIGHTS = "config.json", "model.safetensors"  # a transformers folder's
HF, SAFETENSORS_FORMAT, PT = "hf", "safetensors", "pt"
FORMATS = (HF, SAFETENSORS_FORMAT, PT)  # export's --format
# The train state's keys that describe the model (`Trainer.state_dict`), in a safetensors file's
# metadata as JSON: the model config is `config`'s `model` group.
MODEL_ARGS = ("input_shape", "num_classes")


def load_weights(path: Path, shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """The plain state_dict (single's keys, tied ones too) of a run folder (its newest
    checkpoint), a checkpoint (folder or `checkpoint.pt`, full or sharded), a `.safetensors`
    export, a `torch.save`d state_dict (a `.pt` export, torchvision's weights) or a transformers
    folder (its model.safetensors, in transformers' names). Anything missing or unreadable is a
    ConfigError.

    `shapes_only=True` reads what checks need (keys and shapes) and no more: the tensors may then
    be meta tensors or memory-mapped."""
    try:
        if not path.exists():
            raise ConfigError(f"no file or folder {path}")
        if is_transformers_folder(path):
            return read_safetensors(transformers_weights(path), shapes_only)
        if path.suffix == SAFETENSORS:
            return read_safetensors(path, shapes_only)
        if path.is_file():
            state = read_torch_file(path, mmap=True)
            if isinstance(state, dict) and isinstance(state.get("model"), dict):
                state = state["model"]  # one of train.py's full checkpoints
            if not isinstance(state, dict) or not all(
                isinstance(value, torch.Tensor) for value in state.values()
            ):
                raise ConfigError(f"{path} holds no state_dict (a dict of tensors)")
            return state
        return load_checkpoint(checked_newest(path), mmap=shapes_only)["model"]
    except ConfigError as error:
        raise ConfigError(what_is_wrong(error)) from error


def weights_config(path: Path) -> dict[str, Any] | None:
    """The model config the weights at `path` were saved with (`load_weights`'s sources):
    {"model": the resolved model group, "input_shape": ..., "num_classes": ...} (the last two
    missing from checkpoints written before they were saved); None for a file without one (a
    `.pt` export, torchvision's weights)."""
    try:
        if is_transformers_folder(path):
            return None
        if path.suffix == SAFETENSORS:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as file:
                metadata = file.metadata() or {}
            if "model" not in metadata:
                return None
            return {key: json.loads(metadata[key]) for key in ("model", *MODEL_ARGS)}
        if path.is_file():
            state = read_torch_file(path, mmap=True)
            return model_config(state) if isinstance(state, dict) and "config" in state else None
        return model_config(load_checkpoint(newest_checkpoint(path), mmap=True))
    except ConfigError as error:
        raise ConfigError(what_is_wrong(error)) from error


def is_transformers_folder(path: Path) -> bool:
    """A folder written by transformers' `save_pretrained` (config.json beside the weights)."""
    return (path / HF_CONFIG).is_file()


def transformers_weights(folder: Path) -> Path:
    weights = folder / HF_WEIGHTS
    if not weights.is_file():
        raise ConfigError(f"{folder} holds no {HF_WEIGHTS} (what save_pretrained writes)")
    return weights


def transformers_config(path: Path) -> dict[str, Any] | None:
    """The config.json of a transformers folder, or of the folder of a safetensors file of
    transformers' (no model config of the template's in its metadata); else None."""
    if path.is_file() and (path.suffix != SAFETENSORS or weights_config(path) is not None):
        return None
    config = (path if path.is_dir() else path.parent) / HF_CONFIG
    return json.loads(config.read_text()) if config.is_file() else None


def checked_newest(source: Path) -> Path:
    """The checkpoint `source` names (`newest_checkpoint`), its files checked against its
    manifest."""
    checkpoint = newest_checkpoint(source)
    check_manifest(checkpoint)
    return checkpoint


def model_config(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's model config: its model group and the model's input shape and classes."""
    return {"model": checkpoint["config"]["model"], **checkpoint.get("model_args", {})}


def what_is_wrong(error: ConfigError) -> str:
    """A checkpoint's ConfigError (`store`'s, worded for trainer.resume) as what is wrong with
    the file alone, for the caller to say which setting or command it was given to."""
    return str(error).removeprefix("trainer.resume: ").split("; ")[0]


def read_safetensors(path: Path, shapes_only: bool) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors in its state_dict's order, each tied key the same tensor as
    the key it is tied to (`export`'s metadata; a file from elsewhere: its tensors as stored)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            stored = {
                key: (
                    torch.empty(file.get_slice(key).get_shape(), device="meta")
                    if shapes_only
                    else file.get_tensor(key)
                )
                for key in file.keys()  # noqa: SIM118 - a safe_open file is no dict
            }
    except (SafetensorError, OSError) as error:
        raise ConfigError(f"{path} is not a readable safetensors file ({error})") from error
    tied = json.loads(metadata.get("tied_keys", "{}"))
    keys = json.loads(metadata.get("state_dict_keys", "null")) or list(stored)
    return {key: stored[tied.get(key, key)] for key in keys}


def shared_storage_keys(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{key: the first key whose tensor it is} for tensors a state_dict holds twice (a full
    checkpoint keeps tied weights shared: torch.save stores shared memory once)."""
    first: dict[tuple, str] = {}
    tied = {}
    for key, tensor in state.items():
        view = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape)
        if view in first:
            tied[key] = first[view]
        else:
            first[view] = key
    return tied


def save_safetensors(
    state: dict[str, torch.Tensor], tied: dict[str, str], config: dict[str, Any], target: Path
) -> None:
    """`state` as a safetensors file, each of `tied`'s keys stored once (under the key it is
    tied to), with `config` and the key order in the metadata."""
    from safetensors.torch import save_file

    tensors = {key: value.contiguous() for key, value in state.items() if key not in tied}
    metadata = {key: json.dumps(value) for key, value in config.items()}
    metadata |= {"state_dict_keys": json.dumps(list(state)), "tied_keys": json.dumps(tied)}
    save_file(tensors, str(target), metadata=metadata)


def export(source: Path, target: Path, file_format: str | None = None) -> None:
    """Write the model's plain state_dict (single's keys) from the checkpoint `source` (a run
    folder: its newest) in `file_format` (FORMATS; None: the target's suffix says, no suffix
    being a folder in the Hugging Face format); whole or not at all, readable as the umask
    allows."""
    try:
        checkpoint_path = checked_newest(source)
        checkpoint = load_checkpoint(checkpoint_path)
    except ConfigError as error:
        raise ConfigError(what_is_wrong(error)) from error
    state = evaluated_weights(checkpoint)
    file_format = file_format or target_format(target)
    if target.is_dir() and file_format != HF:
        raise ConfigError(f"{target} is a folder: give --format hf to write the HF format there")
    target.parent.mkdir(parents=True, exist_ok=True)
    if file_format == HF:
        save_pretrained(state, model_config(checkpoint), target, run_tokenizer(checkpoint_path))
        return
    if file_format == PT:
        write_atomically(target, lambda path: torch.save(state, path))
        return
    # Tied weights: the model's own record of them (a sharded checkpoint reads them back as
    # separate tensors), else (older checkpoints) the tensors a full checkpoint kept shared.
    tied = checkpoint.get("tied_keys") or shared_storage_keys(state)
    config = model_config(checkpoint)
    write_atomically(target, lambda path: save_safetensors(state, tied, config, path))


def evaluated_weights(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The plain state_dict of the weights the run evaluated: under trainer.ema_eval, the
    weight average's (`averaged_weights`), else the model's."""
    if checkpoint["config"]["trainer"].get("ema_eval"):
        return averaged_weights(checkpoint)
    return checkpoint["model"]


def averaged_weights(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A full checkpoint's model state_dict with each parameter its weight average
    (`src/training/ema.py`), which numbers them as `parameter_keys` lists them; buffers and tied
    keys follow."""
    state = dict(checkpoint["model"])
    keys = checkpoint["parameter_keys"]
    for index, entry in checkpoint[EMA_KEY]["state"].items():
        state[keys[index]] = entry[EMA_KEY]
    for key, first in checkpoint["tied_keys"].items():
        state[key] = state[first]
    return state


def target_format(target: Path) -> str:
    """The format a target's suffix asks for: a folder (no suffix) is the Hugging Face format,
    `.safetensors` safetensors, any other suffix a torch file."""
    if not target.suffix:
        return HF
    return SAFETENSORS_FORMAT if target.suffix == SAFETENSORS else PT


def run_tokenizer(checkpoint: Path) -> Path | None:
    """The tokenizer saved in the run folder of `checkpoint` (`<run>/tokenizer/`), if any."""
    for folder in checkpoint.parents:
        if folder.name == CHECKPOINTS:
            found = tokenizer_dir(folder.parent)
            return found if found.is_dir() else None
    return None


def save_pretrained(
    state: dict[str, torch.Tensor],
    config: dict[str, Any],
    target: Path,
    tokenizer: Path | None = None,
) -> None:
    """The model of `config` holding `state`, written by its own `save_pretrained` into the
    folder `target`, with the tokenizer saved in the folder `tokenizer` beside it as
    transformers reads it; whole or not at all: into a folder beside it, then renamed."""
    with torch.device("meta"):
        model = build_model(config["model"], config["input_shape"], config["num_classes"])
    if not hasattr(model, "save_pretrained"):
        raise ConfigError(
            f"{type(model).__name__} has no Hugging Face format (transformers' models and "
            "model=gpt or gpt2_124m have one): export it to a .safetensors or .pt file"
        )
    tied = tied_keys(model)
    model.load_state_dict(state, assign=True)
    tie_again(model, tied)  # assign gave each key a tensor of its own
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    if tokenizer is not None:  # first: one that cannot be written stops before the weights
        try:
            save_for_transformers(tokenizer, partial)
        except ValueError as error:  # a library missing
            shutil.rmtree(partial, ignore_errors=True)
            raise ConfigError(str(error)) from None
    model.save_pretrained(partial)
    readable_as_umask_allows(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.checkpoint.store")
    commands = parser.add_subparsers(dest="command", required=True)
    export_parser = commands.add_parser(
        "export", help="write a checkpoint's model as a plain state_dict (single's keys)"
    )
    export_parser.add_argument("source", type=Path, help="a run folder or a checkpoint")
    export_parser.add_argument(
        "target",
        type=Path,
        help="the file to write: .safetensors (with the model's config), .pt (torch.save), or "
        "a folder (no suffix) in the Hugging Face format (transformers' models, gpt and "
        "gpt2_124m as GPT-2), with the run's tokenizer",
    )
    export_parser.add_argument(
        "--format",
        choices=FORMATS,
        help="the format, whatever the target's suffix (hf: a folder)",
    )
    args = parser.parse_args(argv)
    try:
        export(args.source, args.target, args.format)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
