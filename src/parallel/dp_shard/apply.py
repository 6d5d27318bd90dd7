"""The data-parallel degree `dp_shard` (`parallel=fsdp`, and every layout but dp_replicate
alone) applied: FSDP2's `apply_fsdp`, its mixed-precision policy, its scaler, rank 0's weights
copied to every rank, and the gradients' sync (what it costs: `costs.py`).

Launched and fed like ddp: each data-parallel rank trains on `global batch / dp` samples,
starting from rank 0's weights. Every block of the `nn.Sequential` (blocks that share a parameter
together; then the root, for what is left) is sharded: each parameter is split along its first
dimension into `dp_shard` pieces (DTensors), and so are its gradient and optimizer state (over a
2-D (dp_replicate, dp_shard) mesh, HSDP: replicated across the first). A block's full parameters
are all-gathered just before its forward pass and again before its backward pass, and freed
after; its gradients are reduce-scattered (averaged), so each rank gets the gradient of its own
shard and steps the optimizer on it. Parameters, gradients and optimizer state take 1/dp_shard of
the memory per device, for a second all-gather per block per step (ddp: one all-reduce). On the
accumulation micro-steps that do not step the optimizer, gradients stay whole on each rank until
the last one reduce-scatters them (communication saved for memory, as in DDP's no_sync).

With `trainer.precision=bf16` the gathered parameters are bf16 (half the all-gather traffic and
the memory of the unsharded block) while the shards, the gradient reduction and the optimizer
stay fp32; fp16 alike, its gradients unscaled by a scaler that checks every rank's shard
(`sharded_scaler`). The loop's autocast still runs on top: it leaves bf16 matmuls as they are
and casts to fp32 where it always does (softmax, norms, the loss), so the two agree.

Checkpoints (`mesh_checkpoints.py`) are sharded by default when dp_shard is set: every rank
writes its own shards through torch.distributed.checkpoint and reads back its own, resharded to
however many ranks resume, so no rank holds the whole model (it is still built whole in each
process's host memory before `wrap` shards it). `full` gathers them into single's format
instead; resuming from one, the weights are loaded before sharding and the optimizer state is
split on loading, so the whole model then passes through each process's host memory.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from src.components.model_contract import blocks_of
from src.components.precision import AUTOCAST_DTYPES
from src.config.parallel import Offload
from src.parallel.shares import tied_block_groups


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP's policy for `trainer.precision`: under bf16 or fp16 the parameters are gathered in
    that dtype (half the all-gather, and of a gathered unit's memory) and the gradients reduced
    in fp32, into fp32 shards; under fp32 everything stays fp32."""
    if precision not in AUTOCAST_DTYPES:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=AUTOCAST_DTYPES[precision], reduce_dtype=torch.float32)


def sharded_scaler(device_type: str, enabled: bool, init_scale: float) -> torch.amp.GradScaler:
    """fp16's scaler for a process that holds part of the gradients (its shards, its tp rank's
    split of a layer, its pp rank's stages): ShardedGradScaler all-reduces the inf/NaN check over
    every process, so that all skip the step when any part overflowed (each checking its own,
    one rank would step where another skipped, and their loss scales part)."""
    return ShardedGradScaler(device_type, init_scale=init_scale, enabled=enabled)


def offload_policy(offload: Offload) -> OffloadPolicy:
    """FSDP2's policy for `parallel.offload`: cpu keeps the shards in host memory."""
    return CPUOffloadPolicy() if offload == Offload.cpu else OffloadPolicy()


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
    offload: Offload = Offload.none,
) -> nn.Module:
    """FSDP2 over `mesh` (1-D: shards; 2-D (replicate, shard): HSDP) under `policy`, each of
    `sharding_units` a unit and the root for what is left; with `reshard_after_forward` false,
    a unit gathered for its forward stays gathered until its gradients are reduced; `offload`
    cpu keeps the shards (and their gradients and optimizer state) in host memory."""
    options = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": reshard_after_forward}
    options["offload_policy"] = offload_policy(offload)
    for unit in sharding_units(model):
        fully_shard(unit if len(unit) > 1 else unit[0], **options)
    return fully_shard(model, **options)


def divide_gradients_by(model: nn.Module, factor: int, shards: int) -> None:
    """Every FSDP unit of `model` (sharded over `shards` ranks) divides its reduced gradients by
    `factor` instead of by its ranks (more ranks than `factor`: the others' gradients are
    summed). Summed, then divided: the premultiplied sum torch uses otherwise is NCCL's, which
    gloo lacks. Of one shard FSDP only divides, and a forced sum would divide twice (torch
    2.14.1)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(factor))
            module.set_force_sum_reduction_for_comms(shards > 1)


def copy_from_rank0(model: nn.Module, device: torch.device) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP does when it wraps a model: one
    whose initialisation does not come only from the seeded RNG would otherwise start from
    different weights on each rank. One tensor at a time through `device` (the backend's), so
    the device never holds more than one of them whole."""
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            on_device = tensor.to(device)  # the tensor itself when it is there already
            dist.broadcast(on_device, src=0)
            if on_device is not tensor:
                tensor.copy_(on_device)


def sharding_units(model: nn.Module) -> list[list[nn.Module]]:
    """The blocks grouped into FSDP units: each block on its own, except that blocks sharing a
    parameter (tied embeddings) form one unit, since one unit alone can shard and gather it."""
    blocks = blocks_of(model)
    return [[blocks[index] for index in group] for group in tied_block_groups(model)]


@contextlib.contextmanager
def gradient_sync(model: FSDPModule, enabled: bool) -> Iterator[None]:
    """Off: gradients accumulate unsharded on each rank, reduce-scattered on a later micro-step."""
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in the order that `state_dict` numbers
    them (`single`'s checkpoints key the optimizer state by that number)."""
    name_of = {param: name for name, param in model.named_parameters()}
    return [name_of[param] for group in optimizer.param_groups for param in group["params"]]
