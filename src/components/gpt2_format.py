"""The template's GPT (`models.GPT`) in GPT-2's format as transformers holds it (`GPT2LMHeadModel`:
config.json + model.safetensors): GPT-2's weights read into a GPT (`trainer.init_from`), and a GPT
written as GPT-2 (`python -m src.checkpoint.store export <run> <folder>`).

GPT-2's layers are the GPT's under other names; its Linears are transformers' `Conv1D`s, whose
weights are a Linear's transposed (in x out), and its head is tied to the token embedding. With
the same sizes, GELU (`model.gelu`), biases and LayerNorm epsilon, the two compute the same
logits. A GPT without biases (`model.bias=false`) is GPT-2 with zero biases."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from src.config.base import ConfigError

ARCHITECTURE = "GPT2LMHeadModel"
PREFIX = "transformer."  # GPT2LMHeadModel's body; GPT2Model's own files have none
HEAD = "lm_head.weight"
# A block's layers: the GPT's name -> GPT-2's (after `h.<i>.`), and whether GPT-2's is a Conv1D.
BLOCK_LAYERS = {
    "norm1": ("ln_1", False),
    "attention.qkv": ("attn.c_attn", True),
    "attention.proj": ("attn.c_proj", True),
    "norm2": ("ln_2", False),
    "mlp.0": ("mlp.c_fc", True),
    "mlp.2": ("mlp.c_proj", True),
}
# config.json's activation_function -> model.gelu; export writes torch's own tanh GELU's name.
GELUS = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
ACTIVATIONS = {"erf": "gelu", "tanh": "gelu_pytorch_tanh"}
# GPT-2's attention options as GPT-2 has them: the GPT computes nothing else.
GPT2_ATTENTION = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}
END_OF_TEXT = 50256  # GPT-2's tokenizer's <|endoftext|>: its bos and eos token


@dataclass
class Shape:
    """What must agree between a GPT and GPT-2's weights; None: not known (a weights file
    without its config.json)."""

    n_layer: int
    n_embd: int
    vocab: int
    positions: int
    bias: bool
    tied: bool
    n_head: int | None = None
    gelu: str | None = None
    eps: float | None = None
    dropout: float = 0.0

    @classmethod
    def of_gpt(cls, model: nn.Module) -> Shape:
        embedding, first, head = model[0], model[1], model[-1]
        return cls(
            n_layer=len(model) - 2,
            n_embd=embedding.token.embedding_dim,
            vocab=embedding.token.num_embeddings,
            positions=embedding.position.num_embeddings,
            bias=first.norm1.bias is not None,
            tied=head[1].weight is embedding.token.weight,
            n_head=first.attention.heads,
            gelu="tanh" if first.mlp[1].approximate == "tanh" else "erf",
            eps=first.norm1.eps,
            dropout=embedding.dropout.p,
        )

    @classmethod
    def of_gpt2(cls, weights: dict[str, torch.Tensor], config: dict[str, Any] | None) -> Shape:
        """From GPT-2's weights (in `gpt2_keys`) and, if given, its config.json."""
        config = config or {}
        vocab, n_embd = weights["wte.weight"].shape
        layers = {key.split(".")[1] for key in weights if key.startswith("h.")}
        activation = config.get("activation_function")
        return cls(
            n_layer=config.get("n_layer", len(layers)),
            n_embd=n_embd,
            vocab=vocab,
            positions=weights["wpe.weight"].shape[0],
            bias="h.0.ln_1.bias" in weights,
            tied=config.get("tie_word_embeddings", HEAD not in weights),
            n_head=config.get("n_head"),
            gelu=GELUS.get(activation, activation) if activation else None,
            eps=config.get("layer_norm_epsilon"),
        )


def from_gpt2(
    model: nn.Module, weights: dict[str, torch.Tensor], config: dict[str, Any] | None
) -> dict[str, torch.Tensor]:
    """GPT-2's `weights` (transformers' names; `config` its config.json, if any) in the GPT
    `model`'s keys, its positions cut to the model's (nanoGPT's `crop_block_size`). Weights
    without config.json that are not GPT-2's are returned as they are (the caller checks their
    keys); anything GPT-2's that does not fit `model` is a ConfigError naming what to set."""
    if config is not None:
        check_architecture(config)
    gpt2 = gpt2_keys(weights)
    if "wte.weight" not in gpt2:
        if config is None:
            return weights
        raise ConfigError("holds no GPT-2 weights (no wte.weight in its model.safetensors)")
    ours, theirs = Shape.of_gpt(model), Shape.of_gpt2(gpt2, config)
    check_fits(ours, theirs)
    state = {
        key: gpt2[name].t() if conv1d else gpt2[name]
        for key, name, conv1d in key_pairs(ours.n_layer, theirs.bias)
    }
    state["0.position.weight"] = state["0.position.weight"][: ours.positions]
    # GPT-2's head is its token embedding (tied), or its own lm_head.
    head = state["0.token.weight"] if theirs.tied else gpt2[HEAD]
    state[f"{ours.n_layer + 1}.1.weight"] = head
    return state


def gpt2_keys(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's tensors under GPT2Model's names (`wte.weight`, `h.0.attn.c_attn.weight`, ...),
    the attention's causal-mask buffers (older files hold them) left out."""
    return {
        key.removeprefix(PREFIX): value
        for key, value in weights.items()
        if not key.endswith((".attn.bias", ".attn.masked_bias"))
    }


def key_pairs(n_layer: int, bias: bool) -> list[tuple[str, str, bool]]:
    """(the GPT's key, GPT-2's in GPT2Model's names, whether it is a Conv1D weight) for every
    tensor but the head; biases only with `bias`."""
    kinds = ("weight", "bias") if bias else ("weight",)
    pairs = [("0.token.weight", "wte.weight", False), ("0.position.weight", "wpe.weight", False)]
    for i in range(n_layer):
        for ours, (theirs, conv1d) in BLOCK_LAYERS.items():
            pairs += [
                (f"{i + 1}.{ours}.{kind}", f"h.{i}.{theirs}.{kind}", conv1d and kind == "weight")
                for kind in kinds
            ]
    return pairs + [(f"{n_layer + 1}.0.{kind}", f"ln_f.{kind}", False) for kind in kinds]


def check_architecture(config: dict[str, Any]) -> None:
    """config.json is GPT-2's (transformers' `model_type` gpt2), with no option the GPT lacks."""
    if config.get("model_type") != "gpt2":
        architecture = ", ".join(config.get("architectures") or [str(config.get("model_type"))])
        raise ConfigError(
            f"is a {architecture}, not GPT-2 ({ARCHITECTURE}), the only weights model=gpt "
            "starts from; to train that model as it is, choose model=hf_causal_lm "
            "model.pretrained=<its folder>"
        )
    unlike = [
        f"{option}={config[option]}"
        for option, gpt2s in GPT2_ATTENTION.items()
        if config.get(option, gpt2s) != gpt2s
    ]
    n_embd, n_inner = config.get("n_embd"), config.get("n_inner")
    if n_inner is not None and n_embd is not None and n_inner != 4 * n_embd:
        unlike.append(f"n_inner={n_inner}")
    if unlike:
        raise ConfigError(
            f"is a GPT-2 with {', '.join(unlike)}, which model=gpt has no counterpart for"
        )


def check_fits(ours: Shape, theirs: Shape) -> None:
    """A ConfigError, in one line, naming every setting that makes the GPT other than GPT-2's
    `theirs` (the data's vocabulary and sequence length included)."""
    other = [
        name
        for name in ("n_layer", "n_head", "n_embd", "gelu")
        if getattr(theirs, name) is not None and getattr(theirs, name) != getattr(ours, name)
    ]
    settings = [f"model.{name}={getattr(theirs, name)}" for name in other]
    here = [str(getattr(ours, name)) for name in other]
    if theirs.bias and not ours.bias:
        settings, here = [*settings, "model.bias=true"], [*here, "false"]
    if ours.tied and not theirs.tied:
        settings, here = [*settings, "model.tie_weights=false"], [*here, "true"]
    needs = [f"set {' '.join(settings)} (here {', '.join(here)})"] if settings else []
    if theirs.vocab != ours.vocab:
        needs.append(
            f"its vocabulary is {theirs.vocab} tokens (data.vocab_size rounded up to "
            f"model.vocab_multiple: {ours.vocab} here)"
        )
    if ours.positions > theirs.positions:
        needs.append(
            f"data.seq_len at most {theirs.positions} (its positions; {ours.positions} here)"
        )
    if theirs.gelu not in (None, *ACTIVATIONS):
        needs.append(f"its activation_function {theirs.gelu} has no counterpart in model=gpt")
    if theirs.eps is not None and theirs.eps != ours.eps:
        needs.append(
            f"its LayerNorm epsilon {theirs.eps} has none either (model=gpt's: {ours.eps})"
        )
    if needs:
        raise ConfigError(f"is a GPT-2 of other sizes than this model's: {'; '.join(needs)}")


def gpt2_config(shape: Shape, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of transformers' GPT-2 that computes what a GPT of `shape` does."""
    end_of_text = END_OF_TEXT if shape.vocab > END_OF_TEXT else None
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt2",
        "vocab_size": shape.vocab,
        "n_positions": shape.positions,
        "n_embd": shape.n_embd,
        "n_layer": shape.n_layer,
        "n_head": shape.n_head,
        "n_inner": None,
        "activation_function": ACTIVATIONS[shape.gelu],
        "layer_norm_epsilon": shape.eps,
        **dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), shape.dropout),
        "tie_word_embeddings": shape.tied,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
        "dtype": str(dtype).removeprefix("torch."),
    }


def to_gpt2(model: nn.Module) -> dict[str, torch.Tensor]:
    """The GPT `model`'s weights in GPT2LMHeadModel's names: Conv1D weights transposed, zero
    biases for a GPT without them, the head only when it is not tied."""
    shape = Shape.of_gpt(model)
    state = model.state_dict()
    tensors = {}
    for key, name, conv1d in key_pairs(shape.n_layer, bias=True):
        if key in state:
            tensors[PREFIX + name] = state[key].t() if conv1d else state[key]
        else:  # a bias the GPT has not: its layer's output width
            weight = state[key.removesuffix("bias") + "weight"]
            tensors[PREFIX + name] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    if not shape.tied:
        tensors[HEAD] = state[f"{shape.n_layer + 1}.1.weight"]
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def save_gpt2(model: nn.Module, folder: Path) -> None:
    """The GPT `model` as transformers' GPT-2 in `folder`: config.json and model.safetensors."""
    from safetensors.torch import save_file

    tensors = to_gpt2(model)
    dtype = tensors[PREFIX + "wte.weight"].dtype
    folder.mkdir(parents=True, exist_ok=True)
    config = gpt2_config(Shape.of_gpt(model), dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
