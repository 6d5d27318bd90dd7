"""Where a pipeline cuts a model, in one place: `cut_at` gives the stages' modules and the stage
that holds each parameter and buffer name, whatever the model; for stages over processes
(parallel.pp) `cut_model` also picks the split points, and for those on one process's devices
(model_parallel, hybrid) `src/parallel/stages/cut.py` does.

An `nn.Sequential` is cut between its children: each stage an `nn.Sequential` of the model's own
blocks (tensor parallel and FSDP, which replace parameters on the modules, reach them). Any other
model is cut before its blocks (`block_names`) by torch's own tracer
(`torch.distributed.pipelining.pipeline`, through torch.export): the stages are graph modules
whose parameters and buffers are the model's own tensors, bound to them by name. torch.export
fixes the shapes it traced (a `view` keeps its sizes), so such stages are traced for each
micro-batch shape they run (training's, each evaluation batch size's). They are traced on a copy
of the model on the meta device, so a model with its blocks anywhere (some on the meta device, as
a pp rank holds those of others) traces alike.

`cut_model`'s split is balanced by the blocks' parameter counts (as the stage cut's is).

A tensor the model uses on several stages (an embedding's weight tied to the head's, as GPT-2's)
stays one tensor on its first stage (`Cut.stage_of`); `Cut.uses` says which stages use each
name, and `Cut.ties` lists those tensors: each stage's process or device runs on a copy of its
own, whose gradients the strategy sums with the first's, as Megatron-LM does for its first and
last stage (`tied.TiedCopy`, `stages.pipeline.Pipeline.run_stage`).
"""

from __future__ import annotations

import copy
import functools
import itertools
import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from src.components.batches import Tree, tensors
from src.components.model_contract import block_names, blocks_of
from src.config.base import ConfigError, first_line

META = torch.device("meta")


def balanced_split_points(
    block_sizes: Sequence[int], stages: int, cuttable: Collection[int] | None = None
) -> list[int] | None:
    """Where stages 1.. start, for the contiguous partition with the smallest largest stage,
    cutting only before the blocks in `cuttable` (None: any); None when no partition exists.

    Dynamic programming over (stages used, blocks covered); ties go to the earliest cut.
    """
    blocks = len(block_sizes)
    prefix = [0, *itertools.accumulate(block_sizes)]
    # largest[s][i]: the best largest-stage size when the first i blocks form s stages.
    largest = [[float("inf")] * (blocks + 1) for _ in range(stages + 1)]
    cut = [[0] * (blocks + 1) for _ in range(stages + 1)]
    largest[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, blocks + 1):
            for j in range(s - 1, i):
                if s > 1 and cuttable is not None and j not in cuttable:
                    continue
                candidate = max(largest[s - 1][j], prefix[i] - prefix[j])
                if candidate < largest[s][i]:
                    largest[s][i], cut[s][i] = candidate, j
    if largest[stages][blocks] == float("inf"):
        return None
    points, end = [], blocks
    for s in range(stages, 1, -1):
        end = cut[s][end]
        points.append(end)
    return points[::-1]


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@dataclass(frozen=True)
class Tie:
    """A tensor of the model used on several stages."""

    names: tuple[str, ...]  # the model's names for it, in its order (single's first)
    stages: tuple[int, ...]  # the stages using it, in order


@dataclass(frozen=True)
class Cut:
    """A model cut into stages before blocks `points`."""

    points: list[int]
    # Every parameter and buffer name (shared ones under each name): the stages whose modules
    # hold it, and the first stage using its tensor (where a tied tensor lives).
    uses: dict[str, list[int]]
    stage_of: dict[str, int]
    ties: list[Tie]  # the tensors used on more than one stage
    # The stages' modules for micro-batches shaped like the (meta) batch given.
    modules: Callable[[Tree], list[nn.Module]]
    # Whether the stages are the model's own modules (else traced graph modules that share its
    # tensors only, which tp and FSDP, replacing parameters on the modules, cannot reach).
    shares_modules: bool


def state_names(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `model` by name, a shared tensor under each of its names."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def cut_model(model: nn.Module, stages: int, example: Tree, device: torch.device = META) -> Cut:
    """`model` cut into `stages` stages over processes (parallel.pp), balanced by its blocks'
    parameter counts; `example`: a micro-batch of inputs (meta); `device`: where traced stages
    will run. ConfigError, in one line, where it cannot be cut: fewer blocks than stages, or a
    model torch's tracer cannot cut into stages that run."""
    blocks = list(model) if isinstance(model, nn.Sequential) else blocks_of(model)
    if len(blocks) < stages:
        raise ConfigError(
            f"parallel.pp x parallel.stages_per_rank = {stages} stages, but the model has only "
            f"{len(blocks)} blocks; lower them"
        )
    points = balanced_split_points([parameter_count(block) for block in blocks], stages)
    return cut_at(model, points, example, [device] * stages, "parallel.pp")


def cut_at(
    model: nn.Module,
    points: list[int],
    example: Tree,
    devices: Sequence[torch.device],
    setting: str,
) -> Cut:
    """`model` cut before its blocks `points`, stage i to run on `devices[i]` (where a traced
    stage's graph makes tensors); `example`: a micro-batch of inputs (meta); `setting`: the
    setting that asks for the stages, for messages. ConfigError, in one line, where torch's
    tracer cannot cut it into stages that run."""
    if isinstance(model, nn.Sequential):
        blocks = list(model)  # a slice of a subclass would build the subclass
        bounds = itertools.pairwise([0, *points, len(blocks)])
        parts = [nn.Sequential(*blocks[a:b]) for a, b in bounds]
        stage_of_block = block_stages(points, len(model))
        uses = {name: [stage_of_block[int(name.split(".")[0])]] for name, _ in state_names(model)}
        return Cut(points, uses, *homes(model, uses), lambda _: parts, shares_modules=True)
    names = block_names(model)
    starts = [names[point] for point in points]
    traced = functools.partial(traced_stages, model, starts, list(devices), setting)
    uses = traced_uses(model, traced(example))
    return Cut(points, uses, *homes(model, uses), remembered_by_shape(traced), shares_modules=False)


def block_stages(points: list[int], blocks: int) -> dict[int, int]:
    """The stage of each of `blocks` blocks, the stages starting at blocks `points`."""
    bounds = [0, *points, blocks]
    return {
        b: s for s, (start, end) in enumerate(itertools.pairwise(bounds)) for b in range(start, end)
    }


def remembered_by_shape(
    traced: Callable[[Tree], list[nn.Module]],
) -> Callable[[Tree], list[nn.Module]]:
    """`traced`, once per batch shape."""
    made: dict[str, list[nn.Module]] = {}

    def modules(example: Tree) -> list[nn.Module]:
        shape = repr([(tuple(leaf.shape), leaf.dtype) for leaf in tensors(example)])
        if shape not in made:
            made[shape] = traced(example)
        return made[shape]

    return modules


def traced_stages(
    model: nn.Module,
    starts: list[str],
    devices: list[torch.device],
    setting: str,
    example: Tree,
) -> list[nn.Module]:
    """`model` cut by torch's tracer before the blocks named `starts`, fed `example` (meta):
    traced on a meta copy and run there once, then each stage's parameters and buffers bound to
    `model`'s own, and stage i's graph moved to `devices[i]`. ConfigError (naming `setting`)
    where the tracer fails or its stages do not run in a chain."""
    with torch.no_grad():
        memo = {id(tensor): meta_like(tensor) for _, tensor in state_names(model)}
    shell = copy.deepcopy(model, memo)
    name = type(model).__name__
    where = f"{setting}: torch's pipeline tracer cannot cut {name} before {', '.join(starts)}"
    args = (example,)  # the model's forward takes the inputs as one argument
    try:
        split_spec = dict.fromkeys(starts, SplitPoint.BEGINNING)
        pipe = pipeline(shell, mb_args=args, split_spec=split_spec)
        stages = [pipe.get_stage_module(s) for s in range(pipe.num_stages)]
        with torch.no_grad():
            for stage in stages:
                outputs = stage(*args)
                args = outputs if isinstance(outputs, tuple) else (outputs,)
    except Exception as error:  # noqa: BLE001 - torch.export's and the graph's, of any kind
        raise ConfigError(f"{where}: {first_line(error)}; {RUNS_WITHOUT_CUT}") from None
    check_handed_on(pipe.split_gm.graph, where)
    for stage, device in zip(stages, devices, strict=True):
        bind(stage, model)
        retarget(stage, device)
    return stages


def retarget(stage: nn.Module, device: torch.device) -> None:
    """torch.export keeps the device it traced on (the meta copy's) in the graph, as an argument
    of the ops that make tensors (`arange(..., device=...)`) and of its checks of a tensor's
    device (`_assert_tensor_metadata`): `device` instead, in every graph of `stage`."""

    def moved(value: object) -> object:
        return device if isinstance(value, torch.device) and value == META else value

    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            node.args = torch.fx.node.map_aggregate(node.args, moved)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, moved)
        if isinstance(module, torch.fx.GraphModule):
            module.recompile()


def bind(stage: nn.Module, model: nn.Module) -> None:
    """`stage`'s parameters and buffers replaced by `model`'s of the same names."""
    getters = [
        *(
            (name, model.get_parameter)
            for name, _ in stage.named_parameters(remove_duplicate=False)
        ),
        *((name, model.get_buffer) for name, _ in stage.named_buffers(remove_duplicate=False)),
    ]
    for name, get in getters:
        owner, _, key = name.rpartition(".")
        setattr(stage.get_submodule(owner), key, get(name))


# Where a model cannot be cut at its blocks: what still trains it.
RUNS_WITHOUT_CUT = "choose a strategy without pipeline stages (single, dp, ddp, fsdp, tp, fsdp_tp)"


def check_handed_on(graph: torch.fx.Graph, where: str) -> None:
    """ConfigError unless each traced stage takes exactly what the stage before it returns, in
    order (the first: the model's inputs): torch's stages hand values to the next stage only."""
    calls = [node for node in graph.nodes if node.op == "call_module"]
    for stage, (before, after) in enumerate(itertools.pairwise(calls), start=1):
        picked = sorted(
            (user for user in before.users if user.target is operator.getitem),
            key=lambda user: user.args[1],
        )
        handed = picked or [before]
        if list(after.args) != handed or after.kwargs or any(len(v.users) > 1 for v in handed):
            raise ConfigError(
                f"{where}: stage {stage} takes other values than those stage {stage - 1} "
                f"returns (a value skips a stage, or goes to two), which torch's stages cannot "
                f"hand on; {RUNS_WITHOUT_CUT}"
            )


def traced_uses(model: nn.Module, stages: list[nn.Module]) -> dict[str, list[int]]:
    """The stages whose traced modules hold each of `model`'s parameter and buffer names (bound
    to the model's tensors by name, `bind`); stage 0 for a name no stage holds."""
    held = [{name for name, _ in state_names(module)} for module in stages]
    return {
        name: [s for s, names in enumerate(held) if name in names] or [0]
        for name, _ in state_names(model)
    }


def homes(model: nn.Module, uses: dict[str, list[int]]) -> tuple[dict[str, int], list[Tie]]:
    """The first stage using each name's tensor (under any of its names), and the tensors that
    more than one stage uses."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in state_names(model):
        names_of.setdefault(id(tensor), []).append(name)
    stage_of, ties = {}, []
    for names in names_of.values():
        stages = sorted({stage for name in names for stage in uses[name]})
        stage_of |= dict.fromkeys(names, stages[0])
        if len(stages) > 1:
            ties.append(Tie(tuple(names), tuple(stages)))
    return stage_of, ties


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor like `tensor` on the meta device, a Parameter for a Parameter."""
    meta = torch.empty_like(tensor, device="meta")
    return nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


def place(model: nn.Module, device_of: Callable[[str], torch.device]) -> None:
    """Each parameter and buffer of `model` to `device_of(name)`: a device of memory, or the
    meta device (shapes, no memory). Those moved to memory stay the same tensors (`.data`
    moves them), so that stages bound to them before see them moved."""
    with torch.no_grad():
        for name, tensor in state_names(model):
            device = device_of(name)
            moved = tensor.to(device)
            if moved is tensor:
                continue
            if device != META:
                tensor.data = moved
            else:  # a new tensor: the meta device's cannot take another's data
                owner, _, key = name.rpartition(".")
                setattr(model.get_submodule(owner), key, meta_like(tensor))
