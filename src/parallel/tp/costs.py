"""What tensor parallel costs, for the planner (`mesh_shares.py` prices an N-D layout with it):
each tp rank's share of the model's state, work and activations, and the traffic of a step.

Tensor parallel splits the styled Linears (`apply.tp_styles`) over the tp ranks: a
ColwiseParallel Linear's weight and bias, a RowwiseParallel one's weight (its bias is
replicated), and so their gradients and optimizer state; the FLOPs of those Linears and of the
work between them in a module that holds a pair (an attention over its heads: `pair_holders`),
and the activations saved for backward between a ColwiseParallel module and the RowwiseParallel
one after it (`saved_bytes`). Everything else is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)
from torch.utils.flop_counter import FlopCounterMode

from src.components.batches import Tree, batch_size
from src.components.precision import AUTOCAST_DTYPES
from src.parallel.shares import (
    Messages,
    ModelSizes,
    Segments,
    owned_parameters,
    ring_bytes,
    shapes_only,
)


@dataclass(frozen=True)
class TPSplit:
    """What a model's tensor-parallel styles split of it, per block (from one forward pass)."""

    split_parameter_bytes: list[int]
    """Each block's parameter bytes that the tp ranks split between them."""
    flops: list[int]
    """Each block's forward FLOPs per sample."""
    split_flops: list[int]
    """Of those, the ones the tp ranks split (the styled Linears, attention over its heads)."""
    pair_outputs: list[tuple[int, int]]
    """(block, bytes per sample) of each RowwiseParallel Linear's output: what a pair sums over
    the tp ranks in forward."""
    input_gradients: list[tuple[int, int]]
    """(block, bytes per sample) of each ColwiseParallel Linear's input that needs a gradient:
    what a pair sums over the tp ranks in backward (the model's own input needs none, and
    autograd computes none)."""
    saved_bytes: list[int]
    """Each block's activations saved for backward (bytes per sample; not its parameters)."""
    split_saved_bytes: list[int]
    """Of those, the ones inside a pair (from a ColwiseParallel module's output to the next
    RowwiseParallel module's input), which the tp ranks split."""
    parameter_tensors: list[int]
    """Each block's parameter tensors (one shared by several blocks counted at the first)."""
    distributed_tensors: list[int]
    """Of those, the ones the styles make DTensors (the styled Linears' and norms'), whose
    every optimizer op pays DTensor's dispatch."""
    distributed_layers: list[int]
    """Each block's styled modules that run on DTensors (Linears, norms), each paying
    DTensor's dispatch of its ops forward and backward."""

    def flops_kept(self, blocks: list[int], tp: int) -> float:
        """The share of `blocks`' FLOPs that one of `tp` ranks runs."""
        total = sum(self.flops[b] for b in blocks)
        split = sum(self.split_flops[b] for b in blocks)
        return 1 - (1 - 1 / tp) * split / total if total else 1.0

    def distributed_share(self, blocks: list[int]) -> float:
        """The share of `blocks`' parameter tensors that are DTensors."""
        total = sum(self.parameter_tensors[b] for b in blocks)
        return sum(self.distributed_tensors[b] for b in blocks) / total if total else 0.0

    def activations_kept(self, blocks: list[int], tp: int) -> float:
        """The share of `blocks`' saved activations that one of `tp` ranks holds."""
        total = sum(self.saved_bytes[b] for b in blocks)
        split = sum(self.split_saved_bytes[b] for b in blocks)
        return 1 - (1 - 1 / tp) * split / total if total else 1.0


def tp_kept_bytes(split: TPSplit | None, tp: int, sizes: ModelSizes, blocks: list[int]) -> int:
    """The parameter bytes of `blocks` one of `tp` ranks holds (before FSDP shards them)."""
    whole = sum(sizes.block_parameter_bytes[b] for b in blocks)
    if split is None:
        return whole
    split_bytes = sum(split.split_parameter_bytes[b] for b in blocks)
    return int(whole - (1 - 1 / tp) * split_bytes)


def tp_kept(
    split: TPSplit | None, tp: int, sizes: ModelSizes, blocks: list[int]
) -> tuple[float, float, float]:
    """The shares of `blocks`' parameters (and so gradients and optimizer state), of their FLOPs
    and of their traced activations that one of `tp` ranks keeps (tp splits the activations
    inside its pairs: traced whole, they overstated a tp rank's peak by a third on a tiny GPT)."""
    if split is None:
        return 1.0, 1.0, 1.0
    whole = sum(sizes.block_parameter_bytes[b] for b in blocks)
    state_kept = tp_kept_bytes(split, tp, sizes, blocks) / whole if whole else 1.0
    return state_kept, split.flops_kept(blocks, tp), split.activations_kept(blocks, tp)


def busiest_sums(split: TPSplit, ranks: list[list[int]]) -> list[int]:
    """The bytes per sample of each sum over the tp ranks (`pair_outputs` forward,
    `input_gradients` backward) on the pp rank (by its blocks in `ranks`) whose sums are the
    largest."""
    sums = [*split.pair_outputs, *split.input_gradients]
    return max(([size for block, size in sums if block in blocks] for blocks in ranks), key=sum)


def in_compute_dtype(size: int, precision: str) -> int:
    """`size` fp32 bytes of the Linears' outputs, as they are in the autocast dtype."""
    return size // 2 if precision in AUTOCAST_DTYPES else size


def tp_traffic(
    split: TPSplit, tp: int, ranks: list[list[int]], samples: int, precision: str, sp: bool
) -> dict[str, int]:
    """What the busiest rank sends per step over tp in passes of `samples` samples in all: each
    pair's all-reduce forward and backward (`busiest_sums`); with sequence parallel (`sp`) an
    all-gather and a reduce-scatter in place of each, as much together."""
    size = in_compute_dtype(samples * sum(busiest_sums(split, ranks)), precision)
    if sp:
        each = int((tp - 1) / tp * size)
        return {"activation all-gather": each, "activation reduce-scatter": each}
    return {"activation all-reduce": ring_bytes(size, tp)}


def tp_messages(
    split: TPSplit,
    tp: int,
    ranks: list[list[int]],
    samples: int,
    runs: int,
    precision: str,
    sp: bool,
) -> list[Messages]:
    """The busiest rank's tp messages in `runs` passes of `samples` samples: each pair's
    all-reduce forward and backward (`busiest_sums`; with sequence parallel, `sp`, an all-gather
    and a reduce-scatter in place of each), which the next layer waits for."""
    sums = busiest_sums(split, ranks)
    if not sums:
        return []
    size = in_compute_dtype(samples * sum(sums) // len(sums), precision)
    count = len(sums) * runs
    if sp:
        return [
            Messages("all_gather", count, size, tp, wrapper="tp"),
            Messages("reduce_scatter", count, size, tp, wrapper="tp"),
        ]
    return [Messages("all_reduce", count, size, tp, wrapper="tp")]


def split_parameters(module: nn.Module, style: ParallelStyle) -> list[nn.Parameter]:
    """The parameters of a styled Linear that `style` splits."""
    if isinstance(style, ColwiseParallel):
        return list(module.parameters(recurse=False))
    if isinstance(style, RowwiseParallel):
        return [module.weight]
    return []


def distributes(style: ParallelStyle) -> bool:
    """Whether `style` makes its module's parameters DTensors (split, or replicated for
    sequence parallel's norms); a layout change around a module (PrepareModuleInput) does
    not."""
    return isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel))


def pair_holders(styles: dict[str, ParallelStyle]) -> set[str]:
    """The modules inside a block with a ColwiseParallel and a RowwiseParallel child: what their
    own forward runs between the two (an attention over its heads) is on each rank's share."""

    def parents(style: type[ParallelStyle]) -> set[str]:
        return {name.rpartition(".")[0] for name, s in styles.items() if isinstance(s, style)}

    return {name for name in parents(ColwiseParallel) & parents(RowwiseParallel) if name}


def tp_split(model: nn.Module, styles: dict[str, ParallelStyle], inputs: Tree) -> TPSplit:
    """`styles`' split of `model` (on the meta device) by segment (`Segments`), from one forward
    pass of `inputs`."""
    segments = Segments(model)
    block_of = segments.index_of
    split_bytes = [0] * len(segments)
    outputs: list[tuple[int, int]] = []
    samples = batch_size(inputs)

    input_gradients: list[tuple[int, int]] = []

    def record(block: int):
        def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            outputs.append((block, output.nbytes // samples))

        return hook

    def record_input(block: int):
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if args[0].requires_grad:
                input_gradients.append((block, args[0].nbytes // samples))

        return hook

    handles = []
    distributed, layers = [0] * len(segments), [0] * len(segments)
    for name, style in styles.items():
        module = model.get_submodule(name)
        split_bytes[block_of(name)] += sum(p.nbytes for p in split_parameters(module, style))
        if distributes(style):
            distributed[block_of(name)] += len(list(module.parameters()))
            layers[block_of(name)] += 1
        if isinstance(style, RowwiseParallel):
            handles.append(module.register_forward_hook(record(block_of(name))))
        if isinstance(style, ColwiseParallel):
            handles.append(module.register_forward_pre_hook(record_input(block_of(name))))
    saved = SavedActivations(segments, styles)
    try:
        with shapes_only(), saved, FlopCounterMode(display=False) as counter:
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    by_module = {
        name.partition(".")[2]: sum(counts.values())
        for name, counts in counter.get_flop_counts().items()
    }
    flops, split_flops = [0] * len(segments), [0] * len(segments)
    for index, name in enumerate(segments.names, segments.first):
        flops[index] = by_module.get(name, 0) // samples
    if not segments.sequential:  # the rest's, at its first segment as its parameters are
        in_blocks = sum(by_module.get(name, 0) for name in segments.names)
        flops[0] = (counter.get_total_flops() - in_blocks) // samples
    # The split Linears only: a layout change around a whole module (sequence parallel's
    # PrepareModuleInput on an attention) splits none of its work, and counted it twice.
    for name, style in styles.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            split_flops[block_of(name)] += by_module.get(name, 0) // samples
    for name in pair_holders(styles):  # their own work between the pair: attention over heads
        children = (f"{name}.{child}" for child, _ in model.get_submodule(name).named_children())
        inner = by_module.get(name, 0) - sum(by_module.get(child, 0) for child in children)
        split_flops[block_of(name)] += inner // samples
    per_sample = [[size // samples for size in sizes] for sizes in (saved.whole, saved.split)]
    return TPSplit(
        split_bytes,
        flops,
        split_flops,
        outputs,
        input_gradients,
        *per_sample,
        [len(owned) for owned in owned_parameters(model)],
        distributed,
        layers,
    )


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """The bytes autograd saves for backward in each of `segments` during a forward pass
    (`whole`), and those saved inside one of `styles`' pairs (`split`): after a ColwiseParallel
    module's forward until a RowwiseParallel module's ends (the Rowwise Linear's own input is
    split; the Colwise one's is not). Parameters (and views of them) are not activations."""

    def __init__(self, segments: Segments, styles: dict[str, ParallelStyle]):
        super().__init__(self.pack, lambda tensor: tensor)
        self.whole, self.split = [0] * len(segments), [0] * len(segments)
        self.block, self.in_pair = 0, False
        self.handles = segments.hooks(self.entering)
        for name, style in styles.items():
            if isinstance(style, (ColwiseParallel, RowwiseParallel)):
                opens = isinstance(style, ColwiseParallel)
                hook = self.pair_hook(opens)
                self.handles.append(segments.model.get_submodule(name).register_forward_hook(hook))

    def entering(self, index: int) -> None:
        self.block = index

    def pair_hook(self, opens: bool):
        def hook(module: nn.Module, args: object, output: object) -> None:
            self.in_pair = opens

        return hook

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # By class, not identity: the fake copies of the parameters (`shapes_only`) are ones.
        if not isinstance(tensor, nn.Parameter) and not isinstance(tensor._base, nn.Parameter):
            self.whole[self.block] += tensor.nbytes
            if self.in_pair:
                self.split[self.block] += tensor.nbytes
        return tensor

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)
        for handle in self.handles:
            handle.remove()
