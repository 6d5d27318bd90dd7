"""Activation checkpointing and torch.compile per block of a plain model, before any strategy
wraps it; and the task's sums compiled beside them."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._ops import OpOverloadPacket
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from src.components.model_contract import blocks_of
from src.components.tasks import Task
from src.config.base import ConfigError
from src.config.trainer import Recomputation


def prepare_blocks(
    model: nn.Module,
    recomputation: Recomputation,
    compile: bool,
    checkpoint_ops: Sequence[str] = (),
) -> None:
    """Activation checkpointing, then torch.compile, on every block of the plain model, in
    place, before a strategy wraps it (torchtitan's order): the parameter names and state_dict
    keys stay `single`'s, and each strategy's own units (DDP's hooks and buckets, FSDP's
    per-block sharding, pipeline stages, dp's replicas) hold the prepared blocks.

    Checkpointing is non-reentrant (`torch.distributed._composable.checkpoint`, hooks on the
    block rather than a wrapper module): under `full` a block keeps only its input for backward
    and runs its forward again there, trading that compute for the activations' memory; under
    `selective` it also keeps the outputs of `checkpoint_ops` (aten op names) and takes them
    from there instead of running those ops again (torch's op-level policy). It works with DDP
    without `static_graph`, with FSDP2 and with compiled blocks."""
    if compile:
        keep_kernels_apart_by_aten_capability()
    context = {}
    if recomputation == Recomputation.selective:
        policy = functools.partial(keep_outputs_of, saved_ops(checkpoint_ops))
        context = {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}
    for block in blocks_of(model):
        if recomputation != Recomputation.none:
            checkpoint(block, **context)
        if compile:
            block.__class__ = compiled_class(type(block))


def saved_ops(names: Sequence[str]) -> frozenset[OpOverloadPacket]:
    """The aten ops named (trainer.checkpoint_ops); a name that is none is a ConfigError."""
    unknown = [name for name in names if not hasattr(torch.ops.aten, name)]
    if unknown:
        raise ConfigError(
            f"trainer.checkpoint_ops: torch has no aten op {unknown[0]!r}; name ops as "
            "torch.ops.aten spells them (mm, addmm, bmm, ...)"
        )
    return frozenset(getattr(torch.ops.aten, name) for name in names)


def keep_outputs_of(
    ops: frozenset[OpOverloadPacket], context: Any, op: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    """Selective checkpointing's policy: keep the outputs of `ops`, recompute the rest."""
    kept = getattr(op, "overloadpacket", None) in ops
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def keep_kernels_apart_by_aten_capability() -> None:
    """Under ATEN_CPU_CAPABILITY, inductor caches its kernels on disk apart from the ones it
    built without it (unless TORCHINDUCTOR_CACHE_DIR names a folder of the user's). Its cache
    keys leave the variable out, while its compiler flags follow it: on torch 2.14.1 a kernel
    cached vectorised by a run with the CPU's own kernels failed to build under `default`
    (`at::vec` not declared). A folder this function named is named again: a process started
    under another ATEN_CPU_CAPABILITY inherits its parent's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    shared = default_cache_dir()  # torch names it in the environment once it has used it
    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR", shared)
    if named == shared or named.startswith(f"{shared}-aten-"):
        own = f"{shared}-aten-{capability}" if capability else shared
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = own


@functools.cache
def compiled_class(block_class: type[nn.Module]) -> type[nn.Module]:
    """`block_class` with its forward compiled, one subclass per class (FSDP2 swaps classes
    alike), so that every block of a class shares one compiled function, and its graphs where
    the shapes agree.

    Not `nn.Module.compile()`: that compiles the module's `__call__`, and dynamo skips the frames
    of torch.nn's own code there, so a block built of torch modules only (an MLP's Sequential of
    Linear and ReLU) ran uncompiled. Not a compiled method set on the instance either: dp's
    replicas copy a block's attributes, and a bound method would run the original block. A
    class's forward binds to whichever copy calls it."""
    forward = torch.compile(block_class.forward)
    return type(f"Compiled{block_class.__name__}", (block_class,), {"forward": forward})


class CompiledSums:
    """`task` with its `sums` compiled (`trainer.compile`), everything else its own. The loss
    over a language model's (batch, seq, vocab) logits is then a few fused kernels instead of
    eager passes that each read or write the whole logits (their float copy, the log-softmax,
    its gradient, the accuracy's argmax), as nanoGPT's loss compiles with its model."""

    def __init__(self, task: Task):
        self.task = task
        self.sums = torch.compile(task.sums)

    def __getattr__(self, name: str) -> object:
        return getattr(self.task, name)
