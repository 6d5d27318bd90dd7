"""Hugging Face transformers models as the template's models (`model=hf_causal_lm`,
`model=hf_image_classifier`): built from a config (a model type and its sizes, or a folder
holding `config.json`) with random weights, or loaded from a `save_pretrained` folder. The model
is transformers' own class, its parameter names and `save_pretrained` its own; only its `forward`
returns the logits alone, which the task scores. transformers is optional: it is imported here,
when such a model is built.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from src.components.data_contract import check_image_inputs
from src.config.base import ConfigError, first_line

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model=hf_causal_lm and model=hf_image_classifier need Hugging Face transformers: "
            "pip install transformers"
        ) from None
    transformers.logging.set_verbosity_error()  # its notes on random weights and unused keys
    return transformers


def causal_lm(
    input_shape: Sequence[int],
    num_classes: int,
    config: str = "llama",
    sizes: dict[str, Any] | None = None,
    pretrained: str | None = None,
) -> nn.Module:
    """A transformers causal language model over `num_classes` tokens (the data's vocabulary)
    and sequences of `input_shape[-1]` tokens: `pretrained`'s weights, or random ones from
    `config` (a model type such as llama, gpt2, qwen2, or a folder with config.json) with `sizes`
    (its config's keys: hidden_size, num_hidden_layers, ...)."""
    transformers = transformers_module()
    model_config = hf_config(transformers, pretrained or config, sizes or {}, pretrained is None)
    if pretrained is None:
        model_config.vocab_size = num_classes
        model_config.max_position_embeddings = max(
            input_shape[-1], getattr(model_config, "max_position_embeddings", 0) or 0
        )
    elif model_config.vocab_size < num_classes:
        raise ConfigError(
            f"model.pretrained={pretrained} holds {model_config.vocab_size} tokens, fewer than the "
            f"data's {num_classes}"
        )
    model_config.use_cache = False  # training: no key/value cache returned
    return built(transformers.AutoModelForCausalLM, model_config, pretrained)


def image_classifier(
    input_shape: Sequence[int],
    num_classes: int,
    config: str = "vit",
    sizes: dict[str, Any] | None = None,
    pretrained: str | None = None,
) -> nn.Module:
    """A transformers image classifier for images of `input_shape` (channels, height, width)
    and `num_classes` classes: `pretrained`'s weights (its head replaced where its classes
    differ), or random ones from `config` (vit, convnext, ... or a folder) with `sizes`."""
    check_image_inputs("model=hf_image_classifier", input_shape)
    transformers = transformers_module()
    model_config = hf_config(transformers, pretrained or config, sizes or {}, pretrained is None)
    model_config.num_labels = num_classes
    if pretrained is None:
        model_config.num_channels, model_config.image_size = input_shape[0], input_shape[-1]
    return built(transformers.AutoModelForImageClassification, model_config, pretrained)


def built(auto_class: Any, model_config: Any, pretrained: str | None) -> nn.Module:
    """`auto_class`'s model of `model_config`, random or `pretrained`'s (on the meta device:
    shapes only, nothing read), its forward returning the logits alone."""
    try:
        if pretrained is None or torch.get_default_device().type == "meta":
            model = auto_class.from_config(model_config, dtype=torch.float32)
        else:
            model = auto_class.from_pretrained(
                pretrained, config=model_config, dtype=torch.float32, ignore_mismatched_sizes=True
            )
    except (ValueError, KeyError, OSError) as error:
        raise ConfigError(f"model: transformers cannot build it: {first_line(error)}") from None
    model.__class__ = logits_class(type(model))
    return model


def hf_config(transformers: Any, source: str, sizes: dict[str, Any], random: bool) -> Any:
    """The transformers config of `source`: a folder holding config.json (and, unless `random`,
    weights), or a model type; `sizes` set on it."""
    folder = Path(source).expanduser()
    if folder.is_dir() or "/" in source:
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model: {source} has no config.json (save_pretrained writes one)")
        if not random and not any((folder / name).is_file() for name in WEIGHT_FILES):
            raise ConfigError(
                f"model.pretrained={source} holds no weights ({', '.join(WEIGHT_FILES)})"
            )
        return transformers.AutoConfig.from_pretrained(folder, **sizes)
    try:
        return transformers.AutoConfig.for_model(source, **sizes)
    except ValueError:
        raise ConfigError(
            f"model.config={source}: transformers has no such model type (e.g. llama, gpt2, "
            "qwen2), nor is it a folder with config.json"
        ) from None


@functools.cache
def logits_class(model_class: type[nn.Module]) -> type[nn.Module]:
    """`model_class` whose forward returns the logits alone, under the same name (so that
    `save_pretrained` writes its architecture as transformers knows it), and the same signature
    (what a strategy reads to find the keywords it takes, such as `position_ids`)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        return model_class.forward(self, *args, **kwargs).logits

    signature = inspect.signature(model_class.forward)
    forward.__signature__ = signature.replace(return_annotation=torch.Tensor)
    methods = {"forward": forward, "new_cache": new_cache, "decode": decode}
    return type(model_class.__name__, (model_class,), methods)


# Generation (`components/generation.py`) with transformers' own key/value cache.
def new_cache(self: nn.Module, batch: int) -> Any:
    """An empty cache of the model's own kind (`batch` is the first input's)."""
    return transformers_module().DynamicCache(config=self.config)


def decode(self: nn.Module, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
    """The logits of `tokens`, which follow those in `cache` (at the places after them)."""
    return self(tokens, past_key_values=cache, use_cache=True)
