"""Schemas of `conf/model/`. A model is any `nn.Module` built by `_target_(**settings)`, given
the data's `input_shape` and `num_classes` where its constructor names them
(`src/components/model_contract.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from src.config.base import choices

Gelu = choices("Gelu", "erf tanh", __name__)


@dataclass
class MLPConfig:
    _target_: str = "src.components.models.MLP"
    hidden: int = 256
    """Width of every hidden block."""
    depth: int = 4
    """Hidden Linear+ReLU blocks (the first also flattens its input); with the classifier head,
    depth + 1 blocks for a pipeline to split into stages."""


@dataclass
class ConvNetConfig:
    _target_: str = "src.components.models.ConvNet"
    width: int = 16
    """Channels of every conv block."""
    depth: int = 3
    """Conv blocks (3x3 conv, GroupNorm, ReLU); the first two also pool 2x2, halving the
    height and width."""
    hidden: int = 128
    """Width of the head's hidden layer."""


@dataclass
class DecoderShape:
    """What `gpt` and `moe` share: a GPT-2-style decoder's shape."""

    n_layer: int = 2
    """Transformer blocks; with the embedding and the head, n_layer + 2 blocks for a pipeline to
    split into stages."""
    n_head: int = 2
    """Attention heads per block; n_embd must divide by it."""
    n_embd: int = 64
    """Width of the embeddings and of every block (each head gets n_embd / n_head)."""
    tie_weights: bool = True
    """The vocabulary head shares the token embedding's weight (GPT-2 does)."""
    vocab_multiple: int = 1
    """The embedding and head hold the vocabulary rounded up to a multiple of this (64 takes
    GPT-2's 50257 to nanoGPT's 50304): GPU matmuls run faster on such widths. The extra logits
    are never a target, so training pushes them down."""


@dataclass
class GPTConfig(DecoderShape):
    _target_: str = "src.components.models.GPT"
    bias: bool = True
    """Biases in the Linears and LayerNorms (GPT-2 has them; nanoGPT's default is false, which
    drops them all, LayerNorm(bias=False) included). The vocabulary head has none either way."""
    dropout: float = 0.0
    """nanoGPT's dropout: after the embedding, on the attention weights and on each residual
    branch's output, in training only. Above 0, most strategies no longer reproduce `single`
    (docs/strategies.md#dropout)."""
    gelu: Gelu = Gelu.erf
    """The feed-forwards' GELU: `erf`, the exact one (torch's default, nanoGPT's), or `tanh`, its
    tanh approximation, which GPT-2 was trained with (transformers' `gelu_new`): GPT-2's weights
    (trainer.init_from) compute GPT-2's logits only with it."""


@dataclass
class MoEConfig(DecoderShape):
    _target_: str = "src.components.moe.MoEGPT"
    experts: int = 4
    """Feed-forward experts per block, their weights stacked (experts x in x out)."""
    top_k: int = 2
    """Experts each token goes to (1: Switch, 2: GShard), weighted by the router's
    probabilities."""
    capacity_factor: float = 1.25
    """Each expert takes at most capacity_factor x top_k x seq_len / experts of a sequence's
    tokens (rounded up); choices past it are dropped (the token keeps its residual)."""
    aux_loss_weight: float = 0.01
    """Weight of each block's load-balancing loss (Switch's, per sequence) in the loss; logged
    as aux_loss."""


@dataclass
class FCNConfig:
    _target_: str = "src.components.models.FCN"
    hidden: int = 32
    """Channels of every conv block."""
    depth: int = 3
    """3x3 conv blocks (with GroupNorm and ReLU) at full resolution, before the 1x1 conv to
    per-pixel class logits."""


@dataclass
class ResNetConfig:
    _target_: str = "src.components.resnet.ResNet"
    arch: str = "resnet18"
    """resnet18, resnet34 or resnet50: torchvision's block type and blocks per stage."""
    width: int = 64
    """Channels of the stem and the first stage (the later stages have 2, 4 and 8 times as
    many); torchvision's ResNets have 64."""
    cifar_stem: bool = False
    """A 3x3 stride-1 convolution and no max-pool (for 32x32 inputs such as CIFAR's) instead of
    ImageNet's 7x7 stride-2 convolution and max-pool."""
    weights: str | None = None
    """A local state_dict file to start from (this model's keys or torchvision's ResNet's, e.g.
    saved from `torchvision.models.resnet18()`); None: torchvision's random initialisation.
    Nothing is downloaded."""


@dataclass
class TransformerConfig:
    _target_: str = "src.components.models.Transformer"
    hidden: int = 64
    """Embedding width; it must divide by `heads`."""
    depth: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads per block."""
    bias: bool = True
    """Biases in every Linear and LayerNorm (as `gpt`'s, head included)."""
    dropout: float = 0.0
    """As `gpt`'s: after the embedding, on the attention weights and on each residual branch's
    output, in training only (docs/strategies.md#dropout)."""


# The transformers config keys that size a small model (the options' defaults: CPU-sized).
SMALL_TRANSFORMER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


@dataclass
class HFModelConfig:
    """What the transformers options share."""

    pretrained: str | None = None
    """A folder written by `save_pretrained` (or a hub name, with network): its config and
    weights, instead of random ones."""
    blocks: Any = None
    """The repeated blocks (fsdp's units, the pipelines' cut points): a module's path
    (model.layers) or class names; None: found (src/components/model_contract.py)."""


@dataclass
class HFCausalLMConfig(HFModelConfig):
    _target_: str = "src.components.hf.causal_lm"
    config: str = "llama"
    """A transformers model type (llama, gpt2, qwen2, ...) or a folder holding config.json."""
    sizes: dict[str, Any] = field(
        default_factory=lambda: {**SMALL_TRANSFORMER, "num_key_value_heads": 2}
    )
    """Keys of the transformers config set over `config`'s (its vocab_size is the data's, its
    max_position_embeddings at least the data's sequence length)."""


@dataclass
class HFImageClassifierConfig(HFModelConfig):
    _target_: str = "src.components.hf.image_classifier"
    config: str = "vit"
    """A transformers model type (vit, convnext, ...) or a folder holding config.json; its
    pretrained weights get a new head where their classes differ."""
    sizes: dict[str, Any] = field(default_factory=lambda: {**SMALL_TRANSFORMER, "patch_size": 4})
    """Keys of the transformers config set over `config`'s (its image_size, num_channels and
    num_labels are the data's)."""


@dataclass
class TimmConfig:
    _target_: str = "src.components.timm_model.create"
    name: str = "resnet18"
    """Any model name timm.create_model knows (resnet18, vit_tiny_patch16_224, convnext_atto...)."""
    sizes: dict[str, Any] = field(default_factory=dict)
    """More arguments of its constructor: img_size=32 for a ViT on 32x32 images, depth=..."""
    pretrained: str | None = None
    """A local weights file to start from (nothing is downloaded)."""
    blocks: Any = None
    """As `HFModelConfig.blocks`."""
