"""Tensor memory counted as the planner counts it: torch's `MemTracker`, every tensor storage
alive per device, on CPU too, where the process's resident peak also holds the interpreter,
torch's libraries, the data set and the allocator's caches (696 MB for the default MLP, whose
tensors peak at about 4 MB).

A training run counts its first `TRACED_STEPS` steps (the second holds the optimizer state, as
the planner's trace does) and its first evaluation, and reports the highest peak of them beside
the planner's prediction (`summary.json`'s `tensor_peak_mb`, the sweep report's `tensor peak MB`
column). Counting costs each op of those passes a Python call; later steps run as before, and
dp's replicas run in their threads under the count too (`StorageTracker.thread_safe`)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn, optim
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import MemTracker, _RefType, _WeakRefInfo
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from src.planning.memory_trace import TRACED_STEPS
from src.planning.plans import MB

log = logging.getLogger(__name__)


class NoModuleHooks:
    """What MemTracker asks of its module tracker, tracking no module: no hooks, never in a
    backward pass."""

    is_bw = False

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> NoModuleHooks:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class StorageTracker(MemTracker):
    """MemTracker counting every tensor storage per device, without its module hooks: their
    gradient hooks break the pipeline schedules' `autograd.grad` ("A leaf node was passed to
    _will_engine_execute_node", torch 2.14.1). The peak's Total is the same; what the module
    hooks would label (parameters, gradients, backward temporaries) counts as activations.

    A sparse COO tensor (an `nn.Embedding(sparse=True)`'s gradient) has no storage, which
    MemTracker's count fails on: it counts as its indices and values. Any other tensor without a
    storage (compressed sparse layouts, MKL-DNN) is left out, with one warning per layout."""

    thread_safe = True
    """dp's replica threads run under it too (`replicas.apply.parallel_apply`): the count of
    what is alive, which their ops and storages freed in any thread update, changes under a lock
    (shared unlocked, a module-hooked MemTracker's peak once failed now and then with 'dictionary
    changed size during iteration', 0254e07; two threads could also add one storage twice)."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = NoModuleHooks()
        self.fake_mode_on_entry = active_fake_mode()
        self.left_out: set[torch.layout] = set()
        self.lock = threading.RLock()  # re-entered: `_track` updates the snapshot

    def __enter__(self) -> StorageTracker:
        self.fake_mode_on_entry = active_fake_mode()
        super().__enter__()
        return self

    def _track(self, reftype: _RefType, t: torch.Tensor) -> None:
        """Counts no tensor made under another fake mode than the one entered in: DTensor's
        sharding propagation runs its ops on fake tensors, which torch 2.11's MemTracker counted
        as memory (docs/planner.md); torch 2.14's skips them as this does."""
        if active_fake_mode() is self.fake_mode_on_entry:
            with self.lock:  # two threads may meet one storage (views of a shared parameter)
                for part in self.stored_parts(t):
                    super()._track(reftype, part)

    def _update_snap(self, *args: Any, **kwargs: Any) -> None:
        with self.lock:
            super()._update_snap(*args, **kwargs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        with self.lock:  # it reads the snapshot that other threads update
            super()._update_peak_stats(peak_state)

    def _update_and_maybe_create_winfos(
        self, t: torch.Tensor, reftype: _RefType, update_existing: bool = False
    ) -> set[_WeakRefInfo]:
        """Optimizer state and module tensors (a sparse gradient, SGD's sparse momentum) by their
        stored parts, as `_track` counts them."""
        winfos: set[_WeakRefInfo] = set()
        for part in self.stored_parts(t):
            winfos |= super()._update_and_maybe_create_winfos(part, reftype, update_existing)
        return winfos

    def stored_parts(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The tensors whose storages hold `t`: itself, a sparse COO tensor's indices and values,
        none for another layout without a storage (said once per layout)."""
        if t.layout == torch.sparse_coo:
            return [t._indices(), t._values()]
        if t.layout == torch.strided or is_traceable_wrapper_subclass(t):
            return [t]
        if t.layout not in self.left_out:
            self.left_out.add(t.layout)
            log.warning("tensor memory: %s tensors have no storage and are not counted", t.layout)
        return []


def peak_mb(tracker: MemTracker) -> dict[str, float]:
    """The tracker's peak on the device where it is highest, by category and `Total`, in MB."""
    peaks = tracker.get_tracker_snapshot("peak").values()
    peak = max(peaks, key=lambda snapshot: snapshot["Total"])
    return {str(kind): size / MB for kind, size in peak.items()}


class TensorPeak:
    """This process's peak tensor memory over the first `TRACED_STEPS` training steps and the
    first evaluation (`step`, `evaluation`), when `counted`; else nothing is tracked."""

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, counted: bool):
        self.tracker = StorageTracker() if counted else None
        if self.tracker:
            self.tracker.track_external(model, optimizer)  # created before the first step
        self.left = {"step": TRACED_STEPS, "evaluation": 1}  # passes still to count, by kind
        self.peak: float | None = None

    @property
    def counted_steps(self) -> int:
        """How many of the first training steps run under the tracker (slower: its dispatch)."""
        return TRACED_STEPS if self.tracker else 0

    def step(self) -> contextlib.AbstractContextManager:
        """A training step, counted if it is one of the first."""
        return self.counted("step")

    def evaluation(self) -> contextlib.AbstractContextManager:
        """An evaluation, counted if it is the first."""
        return self.counted("evaluation")

    @contextlib.contextmanager
    def counted(self, kind: str) -> Iterator[None]:
        self.left[kind] -= 1
        if self.tracker is None or self.left[kind] < 0:
            yield
            return
        with self.tracker:  # entered again, its peak starts again from what is alive
            yield
        self.peak = max(self.peak or 0.0, peak_mb(self.tracker)["Total"])

    def peak_mb(self) -> float:
        """The highest peak counted (MB); NaN if nothing was (on CUDA the allocator counts)."""
        return float("nan") if self.peak is None else self.peak
