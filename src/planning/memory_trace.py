"""Each device's share of a training step and of an evaluation batch, traced on fake
tensors: the model is built under torch's FakeTensorMode (shapes, dtypes and storage sizes,
no data) and its share runs under `MemTracker`, whose peaks by category become the device's
`DevicePlan`, shared out as the strategy says (`DeviceShare`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _State
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from src.components.averaged_weights import AveragedWeights
from src.components.blocks import prepare_blocks
from src.components.data import Data, first_samples
from src.components.model_contract import build_model
from src.components.optimizer import block_matrices, build_optimizer
from src.components.precision import autocast
from src.config.base import ConfigError
from src.config.job import JobConfig
from src.parallel.shares import (
    DeviceShare,
    ModelSizes,
    Segments,
    owned_parameters,
    shapes_only,
    tied_segment_groups,
)
from src.planning.plans import DevicePlan
from src.planning.work import WorkCounter

# Measured (src/launch/memory_check.py): the second step's peak has the optimizer state.
TRACED_STEPS = 2
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


class StepMemTracker(MemTracker):
    """`MemTracker` for whole training steps: the model may run several times per step
    (accumulation micro-steps), which MemTracker refuses for a root module. Its per-module
    statistics are dropped at each new forward pass of the root; the peak of the one device
    traced is kept, and apart for the moments `RUNNING` (inside one of `blocks`, each the
    model's block of its index), `LOSS` and `STEPPING` (`phase_peaks`); `by_block`: for each
    block apart, entered and running (an evaluation's)."""

    def __init__(self, blocks: dict[nn.Module, int]) -> None:
        super().__init__()
        self.phase_peaks: dict[Any, dict[Any, int]] = {}
        self.blocks = blocks
        self.block_indices: dict[str, int] = {}  # by the module tracker's names, once they ran
        self.by_block = False

    def _update_peak_stats(self, peak_state: _State) -> None:
        super()._update_peak_stats(peak_state)
        tracker = self._mod_tracker
        if self._in_opt or not (tracker.is_bw or len(tracker.parents) > 1):  # only Global
            self.keep_peak(STEPPING)
            return
        running = [
            self.block_indices[name] for name in tracker.parents if name in self.block_indices
        ]
        if not running:
            self.keep_peak(LOSS)
        else:  # inside a block of a model that is no Sequential: the block's, not the model's
            self.keep_peak((RUNNING, max(running)) if self.by_block else RUNNING)

    def keep_peak(self, moment: Any) -> None:
        """The memory now, as `moment`'s peak if it is the highest yet."""
        for snapshot in self._curr_mem_snap.values():
            if snapshot[_TOTAL_KEY] > self.phase_peaks.get(moment, {}).get(_TOTAL_KEY, -1):
                self.phase_peaks[moment] = dict(snapshot)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        tracker = self._mod_tracker
        root = set(tracker.parents) - {tracker.get_known_fqn(module)} == {"Global"}
        if root and module in self.memory_tracking and not tracker.is_bw:
            self.reset_mod_stats()
        if module in self.blocks:
            self.block_indices[tracker.get_known_fqn(module)] = self.blocks[module]
            if self.by_block:
                self.keep_peak((ENTERING, self.blocks[module]))
        super()._pre_fw_hook(module, inputs)


def meta_model_and_inputs(cfg: DictConfig, data: Data, samples: int) -> tuple[nn.Module, Any]:
    """The model on the meta device and `samples` samples' meta inputs."""
    with torch.device("meta"):
        model = build_model(cfg.model, data.input_shape, data.num_classes)
    inputs, _ = first_samples(data.train, 2)
    shape = (samples, *inputs.shape[1:])
    return model, torch.empty(shape, dtype=inputs.dtype, device="meta")


def model_sizes(cfg: DictConfig, data: Data) -> ModelSizes:
    """Bytes per segment (`Segments`: its parameters) and per sample (inputs, each segment's
    output), from the model built on the meta device and run on fake tensors."""
    model, inputs = meta_model_and_inputs(cfg, data, 1)
    with torch.no_grad(), shapes_only():
        outputs = Segments(model).outputs(inputs)
    return ModelSizes(
        block_parameter_bytes=[sum(p.nbytes for p in owned) for owned in owned_parameters(model)],
        input_bytes=inputs.nbytes,
        block_output_bytes=[
            sum(leaf.nbytes for leaf in tree_leaves(output) if torch.is_tensor(leaf))
            for output in outputs
        ],
        shared_blocks=tied_segment_groups(model),
    )


def check_traceable(model: nn.Module, shares: list[DeviceShare]) -> None:
    """ConfigError, in one line, where a share runs part of a model that is not an
    nn.Sequential: the planner traces pipeline stages as runs of a Sequential's children."""
    segments = Segments(model)
    whole = [(0, len(segments))]
    if not segments.sequential and any(s.stage_blocks(len(segments)) != whole for s in shares):
        raise ConfigError(
            "the planner prices pipeline stages of an nn.Sequential only; "
            f"{type(model).__name__} is not one: plan a strategy without them "
            "(single, dp, dp_criterion, ddp, fsdp, mesh, tp, fsdp_tp)"
        )


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


def share_key(share: DeviceShare) -> tuple:
    """What a share's trace depends on: shares equal in these trace the same (the label, the
    sharding and what the strategy adds are applied after, in `device_plan`)."""
    return (
        share.samples,
        share.blocks,
        share.later_stages,
        share.parts,
        share.gather,
        share.replica_only,
        share.computes_in,
    )


def trace_share(
    job: JobConfig, data: Data, share: DeviceShare, eval_share: DeviceShare
) -> TracedShare:
    """`share`'s part of two training steps on fake tensors, then `eval_share`'s part of one
    evaluation batch. The first step creates the optimizer state and counts the work (apart
    from the tracker, whose hooks are work of no step's); the second,
    tracked by MemTracker with that state held, gives the peaks by category (the first step's
    are never higher: it holds no optimizer state). The evaluation runs as the loop's does: the
    model in eval mode, under no_grad, beside the optimizer state (the gradients are gone)."""
    cfg, trainer = job.cfg, job.trainer
    task = instantiate(cfg.task)
    sample_inputs, sample_targets = first_samples(data.train, 1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with built_in(share.computes_in):  # its state is counted in fp32 by `in_categories`
            model = build_model(cfg.model, data.input_shape, data.num_classes)
        prepare_blocks(model, trainer.activation_checkpointing, False, trainer.checkpoint_ops)
        segments = Segments(model)
        ranges = share.stage_blocks(len(segments))  # another model's whole: `check_traceable`
        stages = nn.ModuleList(
            nn.Sequential(*segments.blocks[start:end]) if segments.sequential else model
            for start, end in ranges
        )
        optimizer = build_optimizer(cfg.optimizer, stages.parameters(), block_matrices(model))
        # The weight average (trainer.ema_decay), counted as optimizer state.
        average = None
        if trainer.ema_decay is not None:
            average = AveragedWeights(list(stages.parameters()), trainer.ema_decay)
        lasts = [end == len(segments) for _, end in ranges]
        step = ShareStep(stages, share, task, lasts)
        templates = [
            stage_inputs(model, start, share.samples, sample_inputs) for start, _ in ranges
        ]
        eval_step = ShareStep(stages, eval_share, task, lasts)
        eval_templates = [
            stage_inputs(model, start, eval_share.samples, sample_inputs) for start, _ in ranges
        ]

        def training_step(stepping: contextlib.AbstractContextManager | None = None) -> None:
            for _ in range(trainer.accumulate):
                inputs = [
                    fresh_inputs(template, from_stage=start > 0)
                    for template, (start, _) in zip(templates, ranges, strict=True)
                ]
                targets = sample_targets.new_zeros(share.samples, *sample_targets.shape[1:])
                with autocast("cpu", trainer.precision):
                    loss = step(inputs, targets)
                loss.backward()
            if not share.replica_only:  # a replica's gradients go to the output device
                with stepping or contextlib.nullcontext():
                    optimizer.step()
                    if average is not None:
                        average.step()
            optimizer.zero_grad(set_to_none=True)

        def evaluation_batch() -> None:
            inputs = [fresh_inputs(template, from_stage=False) for template in eval_templates]
            targets = sample_targets.new_zeros(eval_share.samples, *sample_targets.shape[1:])
            stages.eval()
            with torch.no_grad(), autocast("cpu", trainer.precision):
                eval_step(inputs, targets)
            stages.train()

        optimizer_work = WorkCounter()  # its own ops, which `work` counts too
        with WorkCounter() as work:
            training_step(optimizer_work)
        # A Sequential runs nothing outside its blocks; another model runs its rest outside
        # them (its segment 0: FSDP's root unit), inside the model as a whole.
        if segments.sequential:
            blocks = zip(stages, ranges, strict=True)
            indices = {
                block: start + i for stage, (start, _) in blocks for i, block in enumerate(stage)
            }
        else:
            indices = {model: 0, **{block: index for index, block in segments.indexed()}}
        tracker = StepMemTracker(indices)
        tracker.track_external(step, optimizer, *([] if average is None else [average]))
        with tracker:
            training_step()
        peaks = phase_peaks(tracker)
        tracker.phase_peaks, tracker.by_block = {}, True
        with tracker:  # entered again: its peak starts again from what is alive
            evaluation_batch()
        evaluation = phase_peaks(tracker)
    whole = step_temporaries(peaks) if getattr(optimizer, "steps_whole_matrices", False) else 0
    return TracedShare(peaks, work, optimizer_work.ops, evaluation, trainer.accumulate, whole)


def step_temporaries(peaks: dict[Any, dict[Any, int]]) -> int:
    """The optimizer's memory at its step beyond the state it holds while the model runs: what
    its step makes and frees (0 where MemTracker's internals gave no phases)."""
    if STEPPING not in peaks:
        return 0
    return max(0, peaks[STEPPING][_MemRefType.OPT] - peaks[RUNNING][_MemRefType.OPT])


@contextlib.contextmanager
def built_in(dtype: torch.dtype | None) -> Iterator[None]:
    """Floating-point parameters and buffers made in the block are `dtype` (None: unchanged).
    Fake models are not cast after they are built: `Module.to` swaps a fake tensor's
    storage, which torch refuses where a weak reference to it exists."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype or before)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def phase_peaks(tracker: StepMemTracker) -> dict[Any, dict[Any, int]]:
    """The tracker's peak at each moment; where MemTracker's internals recorded none (another
    torch's), its whole peak, taken as the model's: what the strategy holds while it runs is
    added to it."""
    (whole,) = tracker.get_tracker_snapshot("peak").values()
    return dict(tracker.phase_peaks) or {RUNNING: dict(whole)}


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


def stage_inputs(model: nn.Module, start: int, samples: int, sample_inputs: torch.Tensor) -> Any:
    """What block `start` takes for `samples` samples (fake): the data, or (before tracking
    starts) the previous blocks' output (of a Sequential: `check_traceable`), as a template
    for `fresh_inputs`."""
    inputs = sample_inputs.new_zeros(samples, *sample_inputs.shape[1:])
    if start == 0:
        return inputs
    with torch.no_grad():
        return nn.Sequential(*list(model)[:start])(inputs)


def fresh_inputs(template: Any, from_stage: bool) -> Any:
    """A new micro-batch shaped like `template`; a previous stage's activations (`from_stage`)
    arrive needing the gradient this stage sends back."""

    def fresh(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(tensor).requires_grad_(from_stage and tensor.is_floating_point())

    return tree_map(fresh, template)


class ShareStep(nn.Module):
    """A device's forward pass and loss: what it backpropagates, over each of its stages (one,
    unless an interleaved pipeline gives it several), all of them kept for one backward."""

    def __init__(self, stages: nn.ModuleList, share: DeviceShare, task: Any, lasts: list[bool]):
        super().__init__()
        self.stages, self.share, self.task, self.lasts = stages, share, task, lasts

    def forward(self, inputs: list[Any], targets: torch.Tensor) -> torch.Tensor:
        pairs = zip(self.stages, inputs, self.lasts, strict=True)
        return sum(self.stage_loss(stage, x, targets, last) for stage, x, last in pairs)

    def stage_loss(
        self, stage: nn.Sequential, inputs: Any, targets: torch.Tensor, last: bool
    ) -> torch.Tensor:
        """The loss sum (over `share.parts` parts, their outputs concatenated first when
        `share.gather`), or, before the last stage, its outputs' sum (whose gradient stands for
        the one the next stage sends back)."""
        parts = [stage(part) for part in split_parts(inputs, self.share.parts)]
        if not last:
            return sum(leaf.float().sum() for part in parts for leaf in tree_leaves(part))
        if self.share.gather:
            return self.task.sums(torch.cat(parts), targets)[0]
        target_parts = targets.tensor_split(len(parts))
        pairs = zip(parts, target_parts, strict=True)
        return sum(self.task.sums(out, tgt)[0] for out, tgt in pairs)


def split_parts(inputs: Any, parts: int) -> list[Any]:
    leaves, spec = tree_flatten(inputs)
    chunks = [leaf.tensor_split(parts) for leaf in leaves]
    return [tree_unflatten([c[i] for c in chunks], spec) for i in range(parts)]
