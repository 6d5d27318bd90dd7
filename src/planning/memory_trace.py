"""Each device's share of a training step and of an evaluation batch, traced on fake
tensors: the model is built under torch's FakeTensorMode (shapes, dtypes and storage sizes,
no data) and its share runs under `MemTracker`, whose peaks by category, at each moment of the
step, are what the trace found (`TracedShare`); `device_memory.py` makes them the device's
`DevicePlan`, shared out as the strategy says (`DeviceShare`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _State
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from src.components.averaged_weights import AveragedWeights
from src.components.blocks import prepare_blocks
from src.components.data_contract import Data, first_samples
from src.components.model_contract import build_model
from src.components.optimizer import block_matrices, build_optimizer
from src.components.precision import autocast
from src.components.tasks import build_task
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
from src.planning.device_memory import ENTERING, LOSS, RUNNING, STEPPING, TracedShare
from src.planning.work import WorkCounter

# Measured (src/launch/memory_check.py): the second step's peak has the optimizer state.
TRACED_STEPS = 2


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


def share_key(share: DeviceShare) -> tuple:
    """What a share's trace depends on: shares equal in these trace the same (the label, the
    sharding and what the strategy adds are applied after, in `device_memory.device_plan`)."""
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
    task = build_task(cfg.task)
    sample_inputs, sample_targets = first_samples(data.train, 1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        # Its state is counted in fp32 by `device_memory.in_categories`.
        with built_in(share.computes_in):
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
