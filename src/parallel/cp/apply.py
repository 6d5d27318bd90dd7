"""Context parallel applied (issue #43): the sequence cut of a batch and of the model's positions
(torch's head-tail order, `shard_sequence`), `apply_cp` (a forward pass and its loss on this
rank's share of every sequence, inside `ring.ring_attention`), and cp's refusals of a model
(`check_attention`). The `cp` degree of the mesh calls them; nothing here knows the other
degrees.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental._context_parallel import _attention, _load_balancer
from torch.overrides import TorchFunctionMode

from src.components.batches import Tree
from src.config.base import ConfigError
from src.parallel.base import LossFn
from src.parallel.shares import shapes_only

SEQUENCE_OF_BATCH = 1
"""Of a batch of token ids, their labels, a language model's outputs: (batch, sequence, ...)."""
POSITIONS = "position_ids"
"""The keyword by which a model's forward takes its tokens' places in the sequence (transformers'
name); under cp, each rank's tokens' places in the whole sequence."""
NO_PADDING = "attention_mask"
"""The keyword by which a transformers model takes which of its tokens are real (1) and which
padding (0)."""


def shard_sequence(
    mesh: DeviceMesh, tensors: Sequence[torch.Tensor], seq_dims: Sequence[int]
) -> list[torch.Tensor]:
    """This cp rank's share of each tensor (token ids, labels, positions, ...) along its
    sequence dimension: torch's head-tail load balancing cuts the sequence into 2 x cp chunks
    and gives rank r chunks r and 2 x cp - 1 - r, so that under a causal mask every rank attends
    to as many keys. Each rank keeps its tokens' labels and positions beside them."""
    length = tensors[0].shape[seq_dims[0]]
    check_sequence_length(length, mesh.size())
    rank = mesh.get_local_rank()
    order = _load_balancer._HeadTailLoadBalancer(length, mesh.size(), tensors[0].device)
    index = order._generate_indices()[0]
    return [
        t.index_select(dim, index.to(t.device)).chunk(mesh.size(), dim)[rank]
        for t, dim in zip(tensors, seq_dims, strict=True)
    ]


def unshard_sequence(mesh: DeviceMesh, outputs: torch.Tensor, length: int) -> torch.Tensor:
    """Every cp rank's share of `outputs` gathered back into whole sequences of `length`, in
    order (torch's `context_parallel_unshard` with `shard_sequence`'s head-tail order)."""
    order = _load_balancer._HeadTailLoadBalancer(length, mesh.size(), outputs.device)
    (whole,) = _attention.context_parallel_unshard(mesh, [outputs], [SEQUENCE_OF_BATCH], order)
    return whole


def check_sequence_length(length: int, cp: int) -> None:
    """Head-tail load balancing cuts each sequence into 2 x cp equal chunks."""
    if length % (2 * cp):
        raise ConfigError(
            f"parallel.cp={cp} cuts each sequence into 2 x cp = {2 * cp} equal chunks, and its "
            f"{length} tokens (data.seq_len) do not divide by {2 * cp}; change data.seq_len or "
            "parallel.cp"
        )


class AttentionCalls(TorchFunctionMode):
    """Records the mask kind and the key and value bytes of every SDPA call made while it is
    on, and the lengths of the ranges `torch.arange` makes (positions made in the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[str] = []
        self.key_values: list[int] = []
        self.ranges: list[object] = []

    def __torch_function__(
        self,
        func: Callable,
        types: tuple[type, ...],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.masks.append(mask_kind(*args, **kwargs))
            self.key_values.append(key_value_bytes(*args, **kwargs))
        if func is torch.arange:
            self.ranges.append(args[-1] if len(args) < 3 else None)
        return func(*args, **kwargs)


def key_value_bytes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: object, **__: object
) -> int:
    return key.nbytes + value.nbytes


EXPLICIT_MASK = "an explicit attn_mask"


def mask_kind(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    **_: object,
) -> str:
    """'causal', or what the ring cannot take: 'an explicit attn_mask', a dropout's random mask
    (torch's ring fails on it mid-step), 'no (full attention)'."""
    if attn_mask is not None:
        return EXPLICIT_MASK
    if dropout_p:
        return f"a dropout ({dropout_p}) random"
    return "causal" if is_causal else "no (full attention)"


def takes_positions(model: nn.Module) -> bool:
    """Whether the model's forward takes its tokens' places (`POSITIONS`), as transformers'
    language models do."""
    return POSITIONS in inspect.signature(model.forward).parameters


def declares_causal_masks(model: nn.Module) -> bool:
    """Whether the model says that every mask its attention makes is the causal one:
    transformers' `supports_context_parallel` (every layer full causal attention, no sliding
    window, chunks or recurrent state). On fake tensors transformers makes its masks whole,
    values unread; on real ones without padding it calls SDPA causal, mask-free."""
    return getattr(model, "supports_context_parallel", False) is True


def given_positions(
    model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The keywords that give the model's forward the places of `tokens` (`positions`), where
    it takes them: `POSITIONS`, and for a model that `declares_causal_masks`, `NO_PADDING`, all
    real. Without it, transformers takes a cp rank's positions (chunks r and 2 x cp - 1 - r of
    the sequence, not one run) for packed sequences, and masks them from each other."""
    if not takes_positions(model):
        return {}
    keywords = {POSITIONS: positions}
    if declares_causal_masks(model):
        keywords[NO_PADDING] = torch.ones_like(tokens)
    return keywords


def check_attention(model: nn.Module, inputs: torch.Tensor) -> list[int]:
    """ConfigError, in one line, for a model that runs no SDPA (nothing for cp to split) or runs
    it with a mask the ring cannot take (causal only, or any mask of a model that
    `declares_causal_masks`), that makes its positions in the forward pass (`torch.arange`
    over the sequence: each rank would number its share from 0) without taking them
    (`takes_positions`), or whose outputs are not one tensor per token (what `apply_cp` splits
    the loss by). Runs the model once on `inputs` (meta tensors, as `check_model` has them, cost
    nothing; run as fake ones, `shapes_only`), with their positions where it takes them.
    Returns each SDPA call's key and value bytes per sample, for the planner
    (`costs.py`)."""
    length = inputs.shape[SEQUENCE_OF_BATCH]
    whole = torch.arange(length, device=inputs.device).unsqueeze(0)
    positions = given_positions(model, inputs, whole)
    with torch.no_grad(), shapes_only(), AttentionCalls() as calls:
        outputs = model(inputs, **positions)
    if not calls.masks:
        raise ConfigError(
            "parallel.cp splits sequences for attention, and the model runs none "
            "(F.scaled_dot_product_attention); use model=transformer or model=gpt, or parallel.cp=1"
        )
    causal = {"causal", EXPLICIT_MASK} if declares_causal_masks(model) else {"causal"}
    unsupported = sorted(set(calls.masks) - causal)
    if unsupported:
        raise ConfigError(
            f"parallel.cp's ring attention takes causal masks only, and the model's attention has "
            f"{unsupported[0]} mask; use a causal model (model=transformer or model=gpt, or a "
            "transformers model whose every layer is full causal attention: "
            "supports_context_parallel) without attention dropout (model.dropout=0), or "
            "parallel.cp=1"
        )
    if length in calls.ranges and not positions:
        raise ConfigError(
            f"parallel.cp gives each rank a share of every sequence, and the model numbers its "
            f"positions with torch.arange({length}) in its forward pass; keep them in a buffer "
            "named `positions` (as TokenEmbedding does), which cp splits as it splits the tokens"
        )
    if not torch.is_tensor(outputs) or outputs.shape[:2] != inputs.shape[:2]:
        raise ConfigError(
            "parallel.cp splits the loss along the sequence, and the model's outputs are not one "
            "tensor of (batch, sequence, ...) (a mixture of experts' aux loss, say); use "
            "model=transformer or model=gpt, or parallel.cp=1"
        )
    return [size // inputs.shape[0] for size in calls.key_values]


def shard_positions(model: nn.Module, mesh: DeviceMesh) -> None:
    """Each rank's tokens keep their places in the whole sequence: every buffer named
    `positions` (as TokenEmbedding keeps them) cut as `shard_sequence` cuts the tokens, and
    where the forward takes them (`takes_positions`), each call given this rank's."""
    for module in model.modules():
        positions = module._buffers.get("positions")
        if positions is not None:
            module.positions = shard_sequence(mesh, [positions], [0])[0]
    if takes_positions(model):
        given = functools.partial(with_shard_positions, mesh)
        model.register_forward_pre_hook(given, with_kwargs=True)


def with_shard_positions(
    mesh: DeviceMesh, model: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[tuple[object, ...], dict[str, object]]:
    """The forward's arguments with `given_positions`: the places in the whole sequence of
    this rank's share of it, its tokens `args[0]`."""
    tokens = args[0]
    whole = torch.arange(tokens.shape[SEQUENCE_OF_BATCH] * mesh.size(), device=tokens.device)
    (positions,) = shard_sequence(mesh, [whole.unsqueeze(0)], [SEQUENCE_OF_BATCH])
    return args, {**kwargs, **given_positions(model, tokens, positions)}


def apply_cp(
    mesh: DeviceMesh,
    inputs: torch.Tensor,
    targets: Tree,
    fn: LossFn,
    apply: Callable[[Tree, Tree, LossFn], torch.Tensor],
) -> torch.Tensor:
    """`apply(inputs, targets, fn)` (the forward pass and the loss sums) on this cp rank's
    share of every sequence, inside `ring.ring_attention` (which the caller holds open). Targets of
    one label per token are split with the tokens, and the sums summed over the cp ranks (each
    rank's loss then single's: `summed_over`); any other targets (predictions' sample indices)
    get the outputs whole again (`unshard_sequence`)."""
    length = inputs.shape[SEQUENCE_OF_BATCH]
    if torch.is_tensor(targets) and targets.shape[:2] == inputs.shape[:2]:
        ids, labels = shard_sequence(mesh, [inputs, targets], [SEQUENCE_OF_BATCH] * 2)
        return summed_over(mesh, apply(ids, labels, fn))
    (ids,) = shard_sequence(mesh, [inputs], [SEQUENCE_OF_BATCH])

    def on_whole_sequences(outputs: torch.Tensor, targets: Tree) -> torch.Tensor:
        return fn(unshard_sequence(mesh, outputs, length), targets)

    return apply(ids, targets, on_whole_sequences)


def summed_over(mesh: DeviceMesh, sums: torch.Tensor) -> torch.Tensor:
    """`sums` summed over `mesh`'s ranks in value, and this rank's own in gradient: each rank
    backpropagates its own tokens' losses, which the gradients' reduction sums."""
    total = sums.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    return sums + (total - sums).detach()
