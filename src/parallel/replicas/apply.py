"""Scatter, replicate, parallel apply, gather: the data flow of `torch.nn.DataParallel`, shared by
`parallel=dp` and `parallel=dp_criterion`.

On CUDA, scatter and replicate are torch.nn.parallel's own functions. On CPU,
`torch.nn.DataParallel` silently becomes a plain call of the module, so a test there would check
nothing; the CPU path below runs the same flow with `parallel.devices` replicas instead: the batch
is chunked as torch chunks it, replica 0 is the module itself and the others are copies that hold
the very same Parameters (so their gradients sum into the originals) and fresh copies of the
buffers, each replica runs in its own thread, and the outputs are concatenated.

Inputs, positional and keyword alike, and outputs may be tensors or tuples, lists and dicts of
them (nested too). As in torch, every tensor is split on dim 0 and anything else is given to
every replica whole; the outputs are gathered by torch's rules on both device types: tensors are
concatenated (0-dim ones stacked into a vector), `None` stays `None`, tuples, lists and dicts
keep their structure, and replicas returning dicts with different keys are an error.

`parallel_criterion` runs a loss the same way, each part on its replica's device, so that the
outputs need not be gathered (`parallel=dp_criterion`).

`parallel_apply` is ours on both device types: torch's re-enters autocast in its worker threads
with the device's default dtype (float16 on CUDA), which turns a bf16 run into an fp16 one, and it
refuses to run without an accelerator.

BatchNorm: as in torch, only replica 0 updates the module's running statistics (the other
replicas' buffers are copies, dropped after the forward pass), from its own chunk of the batch.
A buffer that requires grad is copied differentiably, as torch broadcasts it, so every replica's
rows reach its gradient. A forward without inputs runs once, on the first device, as in torch;
`zero_grad()` called in a replica's forward warns that it has no effect, and has none (torch's
replicas hold copies of the parameters; ours the parameters themselves, whose gradients are put
back after the forward pass).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._utils import ExceptionWrapper
from torch.nn.parallel._functions import Gather
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
from torch.utils._pytree import tree_flatten, tree_unflatten

from src.components.batches import Tree, batch_size
from src.parallel.base import LossFn


def scatter(batch: Any, devices: Sequence[torch.device]) -> list[Any]:
    """One part of `batch` (a tensor, or a tuple/list/dict of them) per device, split on dim 0;
    whatever is not a tensor goes to every part whole.

    Chunks are `Tensor.chunk`'s: 5 samples on 4 devices give 2, 2, 1, and fewer samples than
    devices give fewer parts, so the caller uses only the first `len(parts)` devices.
    """
    if devices[0].type == "cuda":
        return list(torch.nn.parallel.scatter(batch, devices))
    leaves, spec = tree_flatten(batch)
    chunks = [x.chunk(len(devices)) if torch.is_tensor(x) else [x] * len(devices) for x in leaves]
    parts = min((len(leaf_chunks) for leaf_chunks in chunks), default=len(devices))
    return [tree_unflatten([leaf_chunks[i] for leaf_chunks in chunks], spec) for i in range(parts)]


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One copy of `module` per device; gradients of every copy flow into `module`'s Parameters
    (and into its buffers that require grad)."""
    if devices[0].type == "cuda":
        return torch.nn.parallel.replicate(module, devices, detach=not torch.is_grad_enabled())
    shared = {id(parameter): parameter for parameter in module.parameters()}
    graded = [buffer for buffer in module.buffers() if buffer.requires_grad]
    return [module] + [
        copy.deepcopy(module, memo={**shared, **{id(b): b.clone() for b in graded}})
        for _ in devices[1:]
    ]


@contextlib.contextmanager
def running_as_replicas(module: nn.Module, replicas: Sequence[nn.Module]) -> Iterator[None]:
    """While `replicas` of `module` run their forward pass: a `zero_grad()` there warns, as in
    torch, and `module`'s gradients are what they were before (torch's replicas' parameters are
    copies, whose gradients nobody keeps)."""
    gradients = [(parameter, parameter.grad) for parameter in module.parameters()]
    marked = [m for r in replicas for m in r.modules() if not getattr(m, "_is_replica", False)]
    for submodule in marked:
        submodule._is_replica = True  # what torch's replicas say; Module.zero_grad reads it
    try:
        yield
    finally:
        for submodule in marked:
            del submodule._is_replica
        for parameter, gradient in gradients:
            parameter.grad = gradient


def gather(outputs: Sequence[Any], device: torch.device) -> Any:
    """The per-device outputs as one on `device`, by `torch.nn.parallel.gather`'s rules (see
    above); on CUDA its `Gather` joins the tensors, whose backward scatters the gradients."""
    first = outputs[0]
    if torch.is_tensor(first):
        if device.type == "cuda":
            return Gather.apply(device, 0, *outputs)  # 0-dim ones: unsqueezed, with a warning
        return torch.stack(outputs) if first.dim() == 0 else torch.cat(outputs)
    if first is None:
        return None
    if isinstance(first, dict):
        for i, output in enumerate(outputs):
            if output.keys() != first.keys():
                raise ValueError(
                    f"replica {i} returned a dict with keys {sorted(output)} but replica 0 "
                    f"{sorted(first)}: every replica must return the same keys"
                )
        return type(first)((key, gather([o[key] for o in outputs], device)) for key in first)
    columns = [gather(column, device) for column in zip(*outputs, strict=True)]
    return type(first)._make(columns) if hasattr(first, "_fields") else type(first)(columns)


@contextlib.contextmanager
def _dispatch_modes(modes: Sequence[Any]) -> Iterator[None]:
    """The caller's torch dispatch modes (thread-local) in a worker thread too."""
    for mode in modes:
        _push_mode(mode)
    try:
        yield
    finally:
        for _ in modes:
            _pop_mode()


@contextlib.contextmanager
def _selected(device: torch.device, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Make `device` and the caller's stream on it current in a worker thread (CUDA only)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


def parallel_apply(
    fns: Sequence[Callable[..., Any]],
    args: Sequence[tuple[Any, ...]],
    devices: Sequence[torch.device],
    kwargs: Sequence[dict[str, Any]] | None = None,
) -> list[Any]:
    """`fns[i](*args[i], **kwargs[i])` on `devices[i]`, each in its own thread, results in order.

    Grad mode, autocast (enabled, dtype) and dispatch modes are thread-local, so the workers
    copy the caller's. A dispatch mode that is not `thread_safe` (FakeTensorMode, most others)
    cannot be shared: under one, the replicas run one after another in this thread, where the
    mode is. The tensor memory count's is (`src/observe/tensor_memory.py`), so the first steps
    of a run, which it counts, run their replicas in threads as every other step does.
    An exception in a worker is re-raised here, with the worker's traceback in its message.
    """
    kwargs = kwargs or [{}] * len(fns)
    device_type = devices[0].type
    grad_enabled = torch.is_grad_enabled()
    autocast_enabled = torch.is_autocast_enabled(device_type)
    autocast_dtype = torch.get_autocast_dtype(device_type)
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]
    results: list[Any] = [None] * len(fns)
    modes = _get_current_dispatch_mode_stack()
    shared = all(getattr(mode, "thread_safe", False) for mode in modes)
    threaded = len(fns) > 1 and shared

    def work(i: int) -> None:
        try:
            with (
                _dispatch_modes(modes if threaded else []),
                torch.set_grad_enabled(grad_enabled),
                torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_enabled),
                _selected(devices[i], streams[i]),
            ):
                results[i] = fns[i](*args[i], **kwargs[i])
        except Exception:  # noqa: BLE001 - handed to the caller's thread below
            results[i] = ExceptionWrapper(where=f"in replica {i} on device {devices[i]}")

    if not threaded:
        for i in range(len(fns)):
            work(i)
    else:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(fns))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for result in results:
        if isinstance(result, ExceptionWrapper):
            result.reraise()
    return results


class DataParallel(nn.Module):
    """`torch.nn.DataParallel`'s forward pass on CUDA or CPU: the tensors of the positional and
    keyword inputs are scattered on dim 0 (`scatter_kwargs`). With `gather_outputs=False` it
    returns the per-device outputs instead (PyTorch-Encoding's DataParallelModel)."""

    def __init__(self, module: nn.Module, devices: Sequence[torch.device], gather_outputs: bool):
        super().__init__()
        self.module = module
        self.devices = list(devices)
        self.gather_outputs = gather_outputs

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Nothing to split: torch runs the module once, on the first device.
        parts = scatter((inputs, kwargs), self.devices) if inputs or kwargs else [((), {})]
        devices = self.devices[: len(parts)]
        replicas = replicate(self.module, devices)
        args, kwargs_parts = zip(*parts, strict=True)
        with running_as_replicas(self.module, replicas):
            outputs = parallel_apply(replicas, args, devices, kwargs_parts)
        return gather(outputs, self.devices[0]) if self.gather_outputs else outputs


def parallel_criterion(
    fn: LossFn, outputs: Sequence[Any], targets: Tree, devices: Sequence[torch.device]
) -> torch.Tensor:
    """Sum of `fn(outputs[i], targets' part i)` over the parts, each computed on `devices[i]` in
    its own thread, added on `devices[0]`. `outputs` are a replicated model's per-device outputs
    (tensors, tuples or dicts), `targets` the whole batch's (a tensor, tuple or dict), split as
    the inputs were."""
    parts = scatter(targets, devices)
    if len(parts) != len(outputs):
        raise ValueError(
            f"{batch_size(targets)} targets split into {len(parts)} parts for {len(outputs)} "
            "outputs"
        )
    losses = parallel_apply([fn] * len(parts), list(zip(outputs, parts, strict=True)), devices)
    return torch.stack([loss.to(devices[0]) for loss in losses]).sum(0)
