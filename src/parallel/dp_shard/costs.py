"""What the `dp_shard` degree (FSDP2, `apply.py`) costs, for the planner (`mesh_shares.py`
prices an N-D layout with it): the bytes it gathers, the traffic and messages of a step's
all-gathers and reduce-scatters, and its working set beside the traced step (each unit gathered,
the gradients being reduced), measured against torch's FSDP2 (docs/planner.md).
"""

from __future__ import annotations

from typing import Any

import torch

from src.components.precision import AUTOCAST_DTYPES
from src.parallel.shares import Messages, ModelSizes

# torch 2.14's `FSDPParamGroup.wait_for_unshard` holds the previous unit's all-gather output in a
# local through the next unit's copy-out; 2.15 frees it first
# (`FSDPCommContext.release_all_gather_state_for_comm_reuse`).
OUTPUT_KEPT_THROUGH_COPY_OUT = torch.__version__ < "2.15"


def gathered_bytes(fp32_bytes: int, precision: str) -> int:
    """Parameters of `fp32_bytes` as `apply.mixed_precision(precision)` gathers them."""
    return fp32_bytes // 2 if precision in AUTOCAST_DTYPES else fp32_bytes


def micro_step_counts(staged: bool, accumulate: int) -> tuple[int, int]:
    """How often a unit is gathered per micro-step, and its gradients reduced per step: under
    pp (`staged`) each micro-step's schedule run gathers a rank's stages once and reduces their
    gradients; else each unit is gathered for forward and again for backward, and reduced once
    (the micro-steps before the last skip the sync)."""
    return (1, accumulate) if staged else (2, 1)


def sharded_traffic(
    held: int, shards: int, accumulate: int, staged: bool, precision: str
) -> dict[str, int]:
    """What each of `shards` ranks holding `held` bytes (fp32) sends per step: every unit
    gathered (in the autocast dtype under bf16/fp16) and its gradients reduce-scattered as
    `micro_step_counts` says (each rank sends (N - 1) / N of each)."""
    gathers_per_micro_step, reductions = micro_step_counts(staged, accumulate)
    others = (shards - 1) / shards
    gathered = gathered_bytes(held, precision)
    return {
        "parameter all-gather": int(gathers_per_micro_step * accumulate * others * gathered),
        "gradient reduce-scatter": int(reductions * others * held),
    }


def sharded_messages(
    units: list[int], shards: int, accumulate: int, staged: bool, precision: str
) -> list[Messages]:
    """FSDP's messages per step, from each unit's bytes (fp32; under pp a rank's stages are one
    unit), gathered and reduced as `micro_step_counts` says. Each gather but a micro-step's
    first is prefetched while the previous unit computes, and each reduce-scatter runs while
    the next unit's backward does."""
    if not units:
        return []
    gathers_per_micro_step, reductions = micro_step_counts(staged, accumulate)
    gathers = gathers_per_micro_step * accumulate
    gathered = [gathered_bytes(unit, precision) for unit in units]
    each, reduced_each = sum(gathered) // len(units), sum(units) // len(units)
    prefetched, reduced = gathers * len(units) - accumulate, reductions * len(units)
    return [
        Messages("all_gather", accumulate, each, shards, wrapper="fsdp"),
        Messages("all_gather", prefetched, each, shards, overlapped=True, wrapper="fsdp"),
        Messages("reduce_scatter", reduced, reduced_each, shards, overlapped=True, wrapper="fsdp"),
    ]


def sharded_share(
    units: list[int],
    blocks: list[list[int]],
    held: int,
    staged: bool,
    shards: int,
    precision: str,
    device_type: str,
) -> dict[str, Any]:
    """What FSDP adds to the `DeviceShare` (its fields) of a rank holding `held` bytes (fp32),
    its units' `units` in forward order (their `blocks`: `units_in_forward_order`). While a
    block runs: under pp (`staged`) all of its stages gathered (they stay so through the
    schedule's run, and the loss's: `Mesh.wrap`), else `working_set` of its units
    (`forward_working_set` at each block of a forward pass alone, in evaluation). Its gradients
    whole between syncs outside pp (`apply.gradient_sync`). Its parameters gathered, and run, in the
    autocast dtype under bf16/fp16 (`apply.mixed_precision`)."""
    if staged:
        running = {"parameters": gathered_bytes(held, precision)}
    else:
        gathered = [gathered_bytes(unit, precision) for unit in units]
        spans = unit_spans(blocks)
        parameters, gradients = working_set(gathered, units, spans, shards, device_type)
        running = {"parameters": parameters, "gradients": gradients}
    return {
        "running_bytes": running,
        "forward_bytes": running if staged else {},
        "gathered_forward": () if staged else forward_working_set(units, blocks, precision),
        "loss_bytes": running if staged else {},
        "unsynced_gradients_whole": not staged,
        "computes_in": AUTOCAST_DTYPES.get(precision),
    }


def units_in_forward_order(sizes: ModelSizes) -> list[list[int]]:
    """The sharding units' blocks (blocks sharing a parameter together), in the order of their
    first blocks."""
    return sorted(sizes.shared_blocks, key=min)


def unit_spans(blocks: list[list[int]]) -> list[bool]:
    """Whether each sharding unit (its `blocks`) holds blocks that are not neighbours (a tied
    embedding and head)."""
    return [max(b) - min(b) >= len(b) for b in blocks]


def working_set(
    gathered: list[int], reduced: list[int], spans: list[bool], shards: int, device_type: str
) -> tuple[int, int]:
    """FSDP2's largest working set while a block runs beyond what the trace, shared out,
    holds, from each unit's bytes as gathered and as reduced (in forward order; `spans`: its
    blocks are not neighbours): (parameters gathered, gradients being reduced). The trace's
    peak in backward holds some unit i's gradients whole, as autograd makes them; on top of
    that, at the larger of two moments:

    - computing them: unit i gathered, unit i - 1 too (prefetched for the backward that
      follows), and unit i + 1's gradients in the reduce-scatter's input, kept until unit i's
      reduce-scatter (FSDP2 keeps one such buffer);
    - reduce-scattering them: unit i - 1 gathered, and the gradients, copied into the
      reduce-scatter's input (in place of autograd's), reduced into their shard; on CPU gloo
      reduce-scatters a copy of its input, once more.

    A unit that spans (a tied embedding and head) stays gathered from its first block's
    forward to its last one's, and from its last block's backward to the end of backward,
    where its gradients, whole since that block's backward, are reduced (FSDP2's final
    callback): at every such moment, then, beside the others' (its own reduction comes when
    the activations are gone, and is not one). The forward pass holds less: two units
    gathered. Measured on rank 0 (docs/planner.md): the first moment is the peak of a 4-block
    MLP under fsdp 2, the second of a ResNet-18."""
    copies = 2 if device_type == "cpu" else 1
    spanning_gathered = sum(gathered) - sum(apart(gathered, spans))
    spanning_reduced = sum(reduced) - sum(apart(reduced, spans))
    gathered, reduced = apart(gathered, spans), apart(reduced, spans)
    moments = []
    for i, size in enumerate(gathered):
        ahead = gathered[i - 1] if i else 0
        moments.append((size + ahead, sum(reduced[i + 1 : i + 2])))
        moments.append((ahead, (copies - 1) * reduced[i] + reduced[i] // shards))
    parameters, gradients = max(moments, key=sum, default=(0, 0))
    whole = spanning_reduced - spanning_reduced // shards  # beside the trace's shard of them
    return parameters + spanning_gathered, gradients + whole


def apart(sizes: list[int], spans: list[bool]) -> list[int]:
    """The sizes of the units that do not span, in order."""
    return [size for size, span in zip(sizes, spans, strict=True) if not span]


def forward_working_set(
    units: list[int], blocks: list[list[int]], precision: str
) -> tuple[tuple[int, int], ...]:
    """FSDP2's gathered parameters at each block of a forward pass alone (evaluation: nothing to
    reduce), from each unit's bytes (fp32) and blocks, in forward order: (as the block is
    entered, while it runs). A unit is gathered as its first block is entered and resharded
    after its last (a tied embedding and head stay gathered in between). Its parameters are
    copied out of the all-gather's output, which FSDP2 keeps until the next unit's copy-out (to
    overlap that unit's all-gather with this copy-out): the unit gathered last is held twice
    while its blocks run, its output once through the blocks after them. Entering the block
    where a unit is gathered: the previous unit's output beside its own, and on torch 2.14 its
    copied-out parameters too (`OUTPUT_KEPT_THROUGH_COPY_OUT`). Measured on rank 0
    (docs/planner.md): the resnet's evaluation peaks entering its last stage on 2.14, inside it
    on 2.15."""
    gathered = [gathered_bytes(unit, precision) for unit in units]
    starts = {min(unit): size for unit, size in zip(blocks, gathered, strict=True)}
    ranges = [(min(unit), max(unit), size) for unit, size in zip(blocks, gathered, strict=True)]
    moments, output = [], 0
    for block in range(sum(len(unit) for unit in blocks)):
        held = sum(size for first, last, size in ranges if first <= block <= last)
        entering = held + output
        if block in starts:
            entering += starts[block] if OUTPUT_KEPT_THROUGH_COPY_OUT else 0
            output = starts[block]
        moments.append((entering, held + output))
    return tuple(moments)
