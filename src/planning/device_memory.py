"""What tracing a device's share found (`TracedShare`: `memory_trace.py` runs it on fake
tensors), made the device's memory in the plan (`DevicePlan`): MemTracker's categories summed
into the plan's four, then shared out as the strategy says (`DeviceShare`: its state cut and
split, its activations cut, what it holds at each moment of the step added)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch.distributed._tools.mem_tracker import _MemRefType

from src.parallel.shares import DeviceShare
from src.planning.plans import DevicePlan
from src.planning.work import WorkCounter

# MemTracker's categories, summed into the plan's four.
TRACKED_AS = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.BUFFER: "parameters",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "activations",
    _MemRefType.OTH: "activations",
}


# The moments of a step whose peaks the planner compares: while a block runs (forward or
# backward; what a strategy holds then, such as FSDP's gathered units, is added to this one),
# while the task's loss runs outside every block (FSDP has resharded the last unit by then),
# and the rest (the optimizer step). An evaluation's are per block, each as it is entered too
# (`(ENTERING, index)`, `(RUNNING, index)`): FSDP gathers different units at each.
RUNNING, ENTERING, LOSS, STEPPING = "running", "entering", "loss", "stepping"


@dataclass(frozen=True)
class TracedShare:
    """What tracing a share found: its peaks by MemTracker's categories at each moment of a
    training step (`RUNNING`, `LOSS`, `STEPPING`) and of one evaluation batch (each block's
    apart: `StepMemTracker.by_block`); its work per optimizer step (`work.WorkCounter`: aten
    ops, FLOPs by size, bytes moved), of those ops the optimizer's, and its micro-steps per
    optimizer step. `whole_step_bytes`: of the optimizer's memory at its step, the temporaries
    that every rank holds whole however the state is split (Muon's whole matrix: 0 for AdamW,
    whose temporaries are its shards')."""

    peaks: dict[str, dict[Any, int]]
    work: WorkCounter
    optimizer_ops: int
    evaluation: dict[Any, dict[Any, int]]
    micro_steps: int = 1
    whole_step_bytes: int = 0


def device_plan(
    traced: TracedShare, share: DeviceShare, eval_share: DeviceShare, offloaded: bool = False
) -> DevicePlan:
    """`share`'s device at the highest of its traced moments' peaks, each in the plan's
    categories, shared out, with what the strategy adds at that moment (`share.running_bytes`
    while a block runs, `share.loss_bytes` while the loss does); and its evaluation's peak
    (`eval_share`'s). `offloaded` (parallel.offload=cpu): its share of the state is in host
    memory, at the most it holds. Its work: the traced share's, its FLOPs and bytes cut to
    `share.flops_kept`, and of its ops those on DTensors (`share.dtensor_parameters` of the
    optimizer's, `share.dtensor_layers` in each pass)."""
    added = {
        RUNNING: share.running_bytes,
        LOSS: share.loss_bytes,
        STEPPING: unsplit_step_bytes(traced.whole_step_bytes, share),
    }
    devices = []
    for phase, peak in traced.peaks.items():
        # Between syncs (micro-steps before the last, and the last one's until it reduces)
        unsynced = share.unsynced_gradients_whole and traced.micro_steps > 1 and phase != STEPPING
        device = in_categories(peak, share)
        devices.append(shared_out(device, share, added.get(phase, {}), unsynced, offloaded))
    device = max(devices, key=lambda device: device.peak)
    device.host = max(device.host for device in devices)
    # A share computing part of each layer (share.flops_kept) does that part of its work.
    work, kept = traced.work, share.flops_kept
    device.flops_by_size = {size: flops * kept for size, flops in work.flops_by_size.items()}
    device.moved_bytes, device.ops = work.moved_bytes * kept, work.ops
    device.dtensor_ops = traced.optimizer_ops * share.dtensor_parameters
    device.dtensor_layers = share.dtensor_layers * share.parts * traced.micro_steps  # passes
    device.evaluation = evaluation_peak(traced.evaluation, eval_share, offloaded)
    return device


def unsplit_step_bytes(whole: int, share: DeviceShare) -> dict[str, int]:
    """The optimizer's step temporaries that stay whole (`TracedShare.whole_step_bytes`) less
    what `shared_out` leaves of them, splitting them with the state: what it takes off, put
    back (nothing where a replica does not step)."""
    if share.replica_only:
        return {}
    return {"optimizer": whole - int(whole * share.state_kept) // share.state_shards}


def evaluation_peak(
    peaks: dict[Any, dict[Any, int]], share: DeviceShare, offloaded: bool = False
) -> int:
    """The highest of a traced evaluation's moments' peaks (by MemTracker's categories) shared
    out as `share`'s device, each with what the strategy holds at that moment
    (`forward_added`)."""
    return max(
        shared_out(
            in_categories(peak, share), share, forward_added(share, moment), False, offloaded
        ).peak
        for moment, peak in peaks.items()
    )


def forward_added(share: DeviceShare, moment: Any) -> dict[str, int]:
    """What `share`'s strategy adds at a `moment` of a forward pass alone: while the loss runs
    `share.loss_bytes`; as a block is entered or runs (`(ENTERING | RUNNING, index)`)
    `share.forward_bytes` and FSDP's units gathered then (`share.gathered_forward`)."""
    if moment == LOSS:
        return share.loss_bytes
    if moment == STEPPING:
        return {}
    gathered = share.gathered_forward
    if moment == RUNNING:  # a trace without blocks' moments (`phase_peaks`): the most at any
        held = max((max(pair) for pair in gathered), default=0)
    else:
        phase, block = moment
        held = gathered[block][phase == RUNNING] if gathered else 0  # (entering, running)
    return {**share.forward_bytes, "parameters": share.forward_bytes.get("parameters", 0) + held}


def in_categories(peak: dict[Any, int], share: DeviceShare) -> DevicePlan:
    """A traced peak (by MemTracker's categories) as `share`'s device, in the plan's; a share
    traced in `share.computes_in` has its state counted in fp32, as it is held."""
    device = DevicePlan(share.label, share.devices)
    state_scale = 4 // share.computes_in.itemsize if share.computes_in else 1
    for kind, size in peak.items():
        if kind in TRACKED_AS:
            name = TRACKED_AS[kind]
            scale = 1 if name == "activations" else state_scale
            setattr(device, name, getattr(device, name) + size * scale)
    return device


def shared_out(
    device: DevicePlan,
    share: DeviceShare,
    added: dict[str, int],
    whole_gradients: bool = False,
    offloaded: bool = False,
) -> DevicePlan:
    """`device` with its parameters, gradients and optimizer state cut to `share.state_kept`
    and split `share.state_shards` ways (its gradients not, if `whole_gradients`; moved to
    `host` if `offloaded`), its activations cut to `share.activations_kept`, plus what the
    strategy adds on top (`share.extra_bytes`, and `added` at this moment: FSDP's gathered
    units stay on the device when the shards are offloaded)."""
    state = ("parameters", "gradients", "optimizer")
    split = {
        name: int(getattr(device, name) * share.state_kept) // share.state_shards for name in state
    }
    if whole_gradients:
        split["gradients"] = int(device.gradients * share.state_kept)
    split["activations"] = int(device.activations * share.activations_kept)
    if share.replica_only:
        split.update(gradients=0, optimizer=0)
    if offloaded:
        split.update(host=sum(split[name] for name in state), **dict.fromkeys(state, 0))
    device = dataclasses.replace(device, **split)
    for name, size in [*share.extra_bytes.items(), *added.items()]:
        setattr(device, name, getattr(device, name) + size)
    return device
