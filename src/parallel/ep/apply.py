"""The degree `ep` (expert parallel, `parallel=ep`): the experts of each mixture-of-experts layer
(`model=moe`) split over `ep` ranks, each token sent to its expert's rank and back with
`all_to_all` (what that costs: `costs.py`).

torchtitan's design: ep borrows its ranks from dp_shard and adds no processes. dp_shard's ranks
are (dp_shard / ep) x ep, ep varying fastest, so each ep rank is still a data-parallel rank: it
reads its own samples and routes its own tokens, and capacity's drops, each expert's load and
the aux loss are single's, per sequence (`moe.py`). Only the experts' call runs elsewhere
(`exchanged_expert_outputs`): each rank holds experts / ep whole experts (dim 0 of their
stacked weights, a DTensor over the ep ranks); the tokens of its kept choices go to their
experts' ranks (`all_to_all_single`, uneven splits: the counts are exchanged first), through
the experts there, and back. The experts compute on their DTensor parameters' local tensors
(`forward_on_local_tensors`), as torchtitan's do: on DTensors, the dispatch of each op cost
more than the op.

The dense parameters are FSDP-sharded over all of dp_shard as without ep; each experts module
over the dp_shard / ep ranks that hold the same experts (torchtitan's `dp_shard_mod_ep`; HSDP
with dp_replicate). An expert's gradient on its rank sums the contributions of its ep peers'
tokens, so it is divided by the whole data-parallel degree, as the dense ones are (FSDP would
divide by its own mesh's): both are then the gradients of the step's global mean loss.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from src.components.moe import MoEFeedForward, Routing
from src.config.base import ConfigError
from src.config.parallel import Offload
from src.parallel.dp_shard.apply import divide_gradients_by, offload_policy
from src.parallel.layout import Layout


def resolved_ep(ep: int, dp_shard: int) -> int:
    """`parallel.ep`, -1 meaning every dp_shard rank (the `ep` preset's)."""
    return dp_shard if ep == -1 else ep


def check_no_experts_under_ddp(ep: int) -> None:
    """ConfigError, in one line, for ep beside dp_replicate alone, which has no ranks to lend."""
    if ep != 1:
        raise ConfigError(
            f"parallel.ep={ep} borrows its ranks from parallel.dp_shard, and DDP "
            "(parallel.dp_replicate alone) has none; use parallel.dp_shard (parallel=ep)"
        )


def check_degrees(layout: Layout) -> None:
    """ConfigError, in one line, for an ep that the layout cannot lend its ranks."""
    if layout.ep == 1:
        return
    if layout.dp_shard % layout.ep:
        raise ConfigError(
            f"parallel.ep={layout.ep} must divide parallel.dp_shard={layout.dp_shard}, whose "
            "ranks it borrows; change parallel.ep or parallel.dp_shard"
        )
    if layout.tp > 1 or layout.cp > 1 or layout.pp > 1:
        raise ConfigError(
            f"parallel.ep={layout.ep} does not run with parallel.tp, parallel.cp or parallel.pp "
            "above 1 yet; set them to 1"
        )


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [module for module in model.modules() if isinstance(module, MoEFeedForward)]


def check_experts(model: nn.Module, ep: int) -> None:
    """ConfigError, in one line, for ep over a model without experts or with a number of
    experts that ep ranks cannot share evenly."""
    if ep == 1:
        return
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(
            f"parallel.ep={ep} splits a mixture of experts, and this model has none; use "
            "model=moe, or parallel.ep=1"
        )
    experts = layers[0].router.out_features
    if experts % ep:
        raise ConfigError(
            f"model.experts={experts} does not split into parallel.ep={ep} equal shares of "
            "whole experts; make model.experts a multiple of parallel.ep"
        )


def expert_meshes(data_parallel: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """From FSDP's mesh (`Layout.sharding_mesh`: the shards, after dp_replicate under HSDP): the
    one over which each experts module is FSDP-sharded (dp_shard_mod_ep, after dp_replicate
    under HSDP), and the ep one over which the experts are split (the shards unflattened into
    (shards / ep, ep): one root, so that FSDP composes them)."""
    *replicas, _ = data_parallel.mesh_dim_names
    shards = data_parallel.size(len(replicas))
    view = data_parallel._unflatten(len(replicas), (shards // ep, ep), ("dp_shard_mod_ep", "ep"))
    return view[(*replicas, "dp_shard_mod_ep")], view["ep"]


def apply_ep(
    model: nn.Module,
    data_parallel: DeviceMesh,
    ep: int,
    policy: MixedPrecisionPolicy,
    offload: Offload,
) -> None:
    """Split each MoE layer's experts over the ep ranks of `data_parallel` (whole experts, dim
    0), FSDP-shard them over the ranks that hold the same ones (before `apply_fsdp` shards the
    blocks around them), and send its tokens to them (`exchanged_expert_outputs`)."""
    shards, ep_mesh = expert_meshes(data_parallel, ep)
    for layer in moe_layers(model):
        for linear in (layer.experts.up, layer.experts.down):
            for name, parameter in list(linear.named_parameters()):
                split = distribute_tensor(parameter.detach(), ep_mesh, [Shard(0)])
                linear.register_parameter(name, nn.Parameter(split))
        options = {"mesh": shards, "mp_policy": policy, "offload_policy": offload_policy(offload)}
        experts = fully_shard(layer.experts, **options)
        divide_gradients_by(experts, data_parallel.size(), shards.size(-1))
        experts.forward = functools.partial(forward_on_local_tensors, experts, experts.forward)
        layer.expert_outputs = functools.partial(exchanged_expert_outputs, layer, ep_mesh)


def exchanged_expert_outputs(
    layer: MoEFeedForward, ep_mesh: DeviceMesh, x: torch.Tensor, routing: Routing
) -> torch.Tensor:
    """`MoEFeedForward.expert_outputs` with its experts on the ep ranks: this rank's kept
    choices' tokens, sorted by expert, go to their experts' ranks, and their outputs come back
    to be combined as single combines them."""
    batch, seq_len, width = x.shape
    experts, top_k = layer.router.out_features, routing.expert.shape[-1]
    kept = routing.kept.flatten().nonzero().squeeze(1)  # the kept choices, (token, k) order
    expert = routing.expert.flatten()[kept]
    order = expert.argsort(stable=True)
    choices = kept[order]
    counts = torch.bincount(expert, minlength=experts)
    sent = x.reshape(batch * seq_len, width)[choices // top_k]
    group, ranks = ep_mesh.get_group(), ep_mesh.size()
    received_counts = torch.empty_like(counts)  # (source rank, its expert) of this rank's
    dist.all_to_all_single(received_counts, counts, group=group)
    send_splits = counts.view(ranks, -1).sum(1).tolist()
    receive_splits = received_counts.view(ranks, -1).sum(1).tolist()
    received = exchange(sent, receive_splits, send_splits, group)
    outputs = local_expert_outputs(layer.experts, received, received_counts.view(ranks, -1))
    returned = exchange(outputs, send_splits, receive_splits, group)
    per_choice = x.new_zeros(batch * seq_len * top_k, width).index_put((choices,), returned)
    gate = routing.gate.unsqueeze(-1).to(x.dtype)
    return (per_choice.view(batch, seq_len, top_k, width) * gate).sum(2)


def exchange(
    rows: torch.Tensor, receive_splits: list[int], send_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """`rows` sent to the group's ranks in `send_splits` and theirs received in
    `receive_splits`; differentiable (the gradients go back the other way)."""
    return funcol.all_to_all_single_autograd(rows, receive_splits, send_splits, group)


def local_expert_outputs(
    experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """`rows` (from each source rank, its tokens for this rank's experts in order; `counts`:
    (source rank, local expert)) through their experts, in the same order: grouped as the
    experts take them, (local experts, most tokens of one, width), the rest zero."""
    local = counts.shape[1]
    expert = torch.arange(local, device=rows.device).repeat(counts.shape[0])
    expert = expert.repeat_interleave(counts.flatten())
    order = expert.argsort(stable=True)
    per_expert = counts.sum(0)
    starts = per_expert.cumsum(0) - per_expert
    slot = torch.arange(len(order), device=rows.device) - starts[expert[order]]
    grouped = rows.new_zeros(local, int(per_expert.max()), rows.shape[1])
    grouped = grouped.index_put((expert[order], slot), rows[order])
    outputs = experts(grouped)
    return outputs[expert[order], slot][order.argsort()]


def forward_on_local_tensors(
    experts: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], grouped: torch.Tensor
) -> torch.Tensor:
    """The experts' own `forward` on this rank's experts as plain tensors, as torchtitan's
    grouped experts run: it runs after FSDP has gathered their DTensor parameters (over the ep
    ranks), and DTensor's Python dispatch of each op cost more than the ops themselves on CPU
    (docs/strategies.md)."""
    with local_parameters(experts):
        return forward(grouped)


@contextlib.contextmanager
def local_parameters(module: nn.Module) -> Iterator[None]:
    """`module`'s DTensor parameters swapped for their local tensors while in the block:
    `to_local` is differentiable, so each DTensor (FSDP's unsharded parameter) still gets its
    gradient. Swapped in `_parameters`, as `torch.func.functional_call` swaps them: setattr
    takes only an `nn.Parameter` there, and wrapping the local tensor in one would cut it from
    the DTensor's graph."""
    dtensors = [
        (owner, name, parameter)
        for owner in module.modules()
        for name, parameter in owner.named_parameters(recurse=False)
        if isinstance(parameter, DTensor)
    ]
    for owner, name, parameter in dtensors:
        owner._parameters[name] = parameter.to_local()
    try:
        yield
    finally:
        for owner, name, parameter in dtensors:
            owner._parameters[name] = parameter
