"""What a strategy tells the planner (src/planning/) about a step, touching no device: the model's
parts (`Segments`) and sizes, each device's share of the state and the work (`DeviceShare`), and
the messages a rank sends (`Messages`), with the arithmetic every strategy shares (ring and
bucket sizes, tied blocks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.hooks import RemovableHandle

from src.components.model_contract import block_names, blocks_of


def shapes_only() -> FakeTensorMode:
    """Where a model built on the meta device runs a forward pass to be measured: on fake
    tensors, which code that reads values (transformers' checks of its masks) takes for a
    trace and skips, where meta tensors fail."""
    return FakeTensorMode(allow_non_fake_inputs=True)


class Segments:
    """A model's parts in forward order as the planner prices them: `ModelSizes`' and
    `TPSplit`'s lists have an entry for each. An nn.Sequential's are its children (what its
    pipelines cut between). Any other model's are its blocks (`block_names`) between two
    segments of its rest (what lies outside the blocks: stem, embeddings, norms, head), one
    before them and one after, which share the rest's parameters (counted at the first): FSDP's
    root unit holds them, gathered through the model's forward and again through its backward,
    as the planner prices a unit of tied blocks that are not neighbours."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sequential = isinstance(model, nn.Sequential)
        self.names = (
            [name for name, _ in model.named_children()] if self.sequential else block_names(model)
        )
        self.first = 0 if self.sequential else 1  # block 0's segment

    def __len__(self) -> int:
        return len(self.names) + 2 * self.first

    @property
    def blocks(self) -> list[nn.Module]:
        return [self.model.get_submodule(name) for name in self.names]

    def parameters(self) -> list[list[nn.Parameter]]:
        """Each segment's parameters (one shared by several segments in each of them)."""
        blocks = [list(block.parameters()) for block in self.blocks]
        if self.sequential:
            return blocks
        inside = {id(p) for block in blocks for p in block}
        rest = [p for p in self.model.parameters() if id(p) not in inside]
        return [rest, *blocks, rest]

    def indexed(self) -> list[tuple[int, nn.Module]]:
        """Each block with its segment's index."""
        return list(enumerate(self.blocks, self.first))

    def index_of(self, name: str) -> int:
        """The segment of the module `name` (as `named_modules` names it): its block's, else
        the rest's first."""
        for index, block in enumerate(self.names):
            if name == block or name.startswith(f"{block}."):
                return self.first + index
        return 0

    def hooks(self, entered: Callable[[int], None]) -> list[RemovableHandle]:
        """Forward hooks calling `entered(segment)` as each segment starts to run: a block as it
        starts, and the rest's last as a block ends (what runs between blocks is the rest's)."""
        handles = []
        for index, block in self.indexed():
            handles.append(block.register_forward_pre_hook(lambda *_, i=index: entered(i)))
            if not self.sequential:
                handles.append(block.register_forward_hook(lambda *_: entered(len(self) - 1)))
        return handles

    def outputs(self, inputs: Any) -> list[Any]:
        """Each segment's output in a forward pass of `inputs` (what the next segment takes):
        a block's; the rest's first, the first block's positional inputs; the rest's last, the
        model's output."""
        outputs: list[Any] = [None] * len(self)

        def keep(index: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple, *output: Any) -> None:
                outputs[index] = output[0] if output else args  # a forward hook's, a pre-hook's

            return hook

        blocks = self.blocks
        handles = [
            block.register_forward_hook(keep(index))
            for index, block in enumerate(blocks, self.first)
        ]
        if not self.sequential and blocks:
            handles.append(blocks[0].register_forward_pre_hook(keep(0)))
        try:
            output = self.model(inputs)
        finally:
            for handle in handles:
                handle.remove()
        if not self.sequential:
            outputs[-1] = output
        return outputs


@dataclass(frozen=True)
class ModelSizes:
    """What the planner knows of the model before tracing it (bytes, from the meta device); its
    "blocks" are the model's `Segments` (an nn.Sequential's children, as its pipelines cut it)."""

    block_parameter_bytes: list[int]
    """Each block's parameters (one shared by several blocks counted at the first)."""
    input_bytes: int
    """One sample's inputs."""
    block_output_bytes: list[int]
    """One sample's output of each block."""
    shared_blocks: list[list[int]]
    """The blocks grouped by shared parameters (each block alone when it shares none)."""

    @property
    def parameter_bytes(self) -> int:
        return sum(self.block_parameter_bytes)

    def blocks_bytes(self, start: int, end: int) -> int:
        return sum(self.block_parameter_bytes[start:end])


@dataclass(frozen=True)
class DeviceShare:
    """One device's part of a training step, as the planner traces it."""

    label: str
    samples: int
    """Samples per micro-step through this device's blocks."""
    blocks: tuple[int, int] | None = None
    """The blocks it runs, [start, end); None: all."""
    later_stages: tuple[tuple[int, int], ...] = ()
    """The blocks of further pipeline stages it runs, each [start, end) (a looped schedule's
    rank holds stages r, r + pp, ...)."""
    parts: int = 1
    """The samples run in this many parts (replicas, pipeline micro-batches), all kept for
    backward."""
    gather: bool = False
    """The parts' outputs are concatenated before the loss (DataParallel's gather)."""
    state_shards: int = 1
    """Parameters, gradients and optimizer state split this many ways (FSDP)."""
    state_kept: float = 1.0
    """The share of its parameters, gradients and optimizer state it holds before those are
    sharded (tensor parallel: the replicated ones and 1/tp of the split ones)."""
    activations_kept: float = 1.0
    """The share of its traced activations it holds (tensor parallel: those inside a pair are
    split)."""
    flops_kept: float = 1.0
    """The share of its blocks' FLOPs it runs (tensor parallel: 1/tp of the split layers')."""
    dtensor_parameters: float = 0.0
    """The share of its parameter tensors that are DTensors (FSDP2's shards, tensor parallel's
    styled layers): each optimizer op on one pays DTensor's dispatch."""
    dtensor_layers: int = 0
    """The layers it runs forward and backward on DTensors in each pass (tensor parallel's
    styled ones), each paying DTensor's dispatch of its ops."""
    replica_only: bool = False
    """It holds a copy of the parameters but no gradients or optimizer state of its own."""
    extra_bytes: dict[str, int] = field(default_factory=dict)
    """What the strategy adds, by category (parameters, gradients, optimizer, activations)."""
    running_bytes: dict[str, int] = field(default_factory=dict)
    """What the strategy adds only while the model runs (forward and backward, not at the
    optimizer step), by category: FSDP's gathered units and the gradients it reduce-scatters."""
    forward_bytes: dict[str, int] = field(default_factory=dict)
    """What the strategy adds while the model runs forward alone (evaluation), by category, at
    every block: under pp FSDP's gathered stages, ep's exchange, cp's ring."""
    gathered_forward: tuple[tuple[int, int], ...] = ()
    """FSDP's gathered parameters (bytes) at each block of the model in a forward pass alone,
    beside `forward_bytes`: (as the block is entered, while it runs); empty where FSDP gathers
    nothing block by block."""
    loss_bytes: dict[str, int] = field(default_factory=dict)
    """What the strategy adds while the task's loss runs, outside every block: under pp,
    FSDP's gathered stages (without pp FSDP has resharded the last unit by then)."""
    unsynced_gradients_whole: bool = False
    """Its gradients stay whole, not split `state_shards` ways, through the accumulation
    micro-steps that skip the gradient sync (FSDP's, outside pp), until they are reduced."""
    computes_in: torch.dtype | None = None
    """The dtype its parameters are gathered in to run (FSDP's mixed precision), traced so:
    its activations are that dtype's where autocast leaves them."""
    devices: int = 1
    """The devices whose work this share stands for: on CPU one process runs all of a dp's
    replicas or a pipeline's stages, which on GPUs run side by side."""

    def stage_blocks(self, blocks: int) -> list[tuple[int, int]]:
        """Each [start, end) range of the `blocks` blocks that it runs as a stage of its own."""
        return [self.blocks or (0, blocks), *self.later_stages]


# The collectives the planner times (`src/planning/calibration.py` measures each).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


@dataclass(frozen=True)
class Messages:
    """Messages of one kind that one rank takes part in per optimizer step, as the planner
    times them: each costs the collective's latency plus its bytes over its bandwidth, both
    measured at `ranks` processes."""

    collective: str
    """One of `COLLECTIVES` (`send`: a point-to-point send or receive), or "" for none: the
    wrapper's own work alone (dp's replicas run in threads of one process)."""
    count: int
    """Per optimizer step."""
    size: int
    """Bytes of each message's tensor on one rank (all_gather: the gathered output;
    reduce_scatter: the input; all_reduce, all_to_all, send: the tensor)."""
    ranks: int
    overlapped: bool = False
    """It runs while backward computes (DDP's buckets, FSDP's prefetched gathers), so only what
    outlasts the backward adds to the step."""
    wrapper: str = ""
    """What sends it (ddp, fsdp, tp, pp, dp), whose own work per message the calibration
    measures (empty: a bare collective)."""


def owned_parameters(model: nn.Module) -> list[list[nn.Parameter]]:
    """Each segment's parameters (`Segments`), one shared by several at the first of them."""
    seen: set[int] = set()
    owned = []
    for parameters in Segments(model).parameters():
        owned.append([p for p in parameters if id(p) not in seen])
        seen.update(id(p) for p in owned[-1])
    return owned


def tied_block_groups(model: nn.Module) -> list[list[int]]:
    """Blocks (`blocks_of`) that share a parameter, grouped (each alone when it shares none)."""
    return tied_groups([list(block.parameters()) for block in blocks_of(model)])


def tied_segment_groups(model: nn.Module) -> list[list[int]]:
    """Segments (`Segments`) that share a parameter, grouped: the rest's two among them."""
    return tied_groups(Segments(model).parameters())


def tied_groups(parts: list[list[nn.Parameter]]) -> list[list[int]]:
    """The indices of `parts` that share a parameter, grouped (each alone when it shares none)."""
    groups: list[tuple[set[int], list[int]]] = []
    for index, parameters in enumerate(parts):
        params = {id(p) for p in parameters}
        sharing = [g for g in groups if g[0] & params]
        groups = [g for g in groups if g not in sharing]
        merged_ids = params.union(*(g[0] for g in sharing))
        groups.append((merged_ids, sorted([i for g in sharing for i in g[1]] + [index])))
    return [blocks for _, blocks in groups]


def ring_bytes(size: int, ranks: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `size` bytes."""
    return 2 * (ranks - 1) * size // ranks


@dataclass(frozen=True)
class OneDevice:
    """What `single` costs (its `CostModel`): the whole model and batch on one device, nothing
    sent, nothing waited for."""

    device_type: str

    def device_shares(self, sizes: ModelSizes, micro_batch: int) -> list[DeviceShare]:
        return [DeviceShare(f"{self.device_type}:0", micro_batch)]

    def step_traffic(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> dict[str, int]:
        return {}

    def idle_fraction(self) -> float:
        return 0.0

    def step_messages(self, sizes: ModelSizes, micro_batch: int, accumulate: int) -> list[Messages]:
        return []
