"""How a layout's checkpoints hold single's tensors, in single's row order, whatever the layout
(`Mesh` and `Replicated` hand their checkpoint methods to a `SingleLayoutCheckpoints`, which
their `wrap` builds).

`sharded` (the default where the layout shards: dp_shard, tp or pp): every process writes its
own shards through DCP, the pieces of the fused qkv rows that tensor parallel regrouped placed
where they lie in single's tensors, and a pipeline rank the blocks it trains only; any number of
processes of any strategy that reads sharded checkpoints resumes them (DCP reshards); before
torch 2.14, whose DCP cannot place those pieces (`dcp_places_rows`), each rank of a qkv tensor's
mesh gathers it whole and DCP writes it once, and reading one, each rank copies its rows out.
`full`: every process gathers the DTensors whole, the regrouping undone
(`tp/apply.single_layout`), and rank 0 writes them. Under DDP the model is wrapped; its
plain model (`Replicated.unwrap`) is what these methods are given, so that the keys are single's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from src.checkpoint.store import dcp_places_rows, renamed, rows_placed
from src.components.state_dicts import tied_keys
from src.parallel.dp_shard.apply import parameter_names
from src.parallel.pp.run import PipelineRun
from src.parallel.tp.apply import single_layout, tp_layout
from src.parallel.tp.registry import RowOrder


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly distributed) tensor, on the CPU (a collective for a
    DTensor: every rank calls it)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def summed(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor of partial sums (a norm's gradient under sequence parallel, and its momentum:
    the sum left pending) summed, replicated where it was partial; any other tensor as it is."""
    if not isinstance(tensor, DTensor) or not any(p.is_partial() for p in tensor.placements):
        return tensor
    return tensor.redistribute(
        placements=[Replicate() if p.is_partial() else p for p in tensor.placements]
    )


def like(parameter: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` distributed as `parameter` is (this rank's shard of it)."""
    if not isinstance(parameter, DTensor):
        return full.to(parameter.device)
    full = full.to(parameter.device_mesh.device_type)
    return distribute_tensor(full, parameter.device_mesh, parameter.placements)


@dataclass(frozen=True)
class SingleLayoutCheckpoints:
    """The checkpoint methods of `Mesh` and `Replicated`, from what their `wrap` made of the
    model: the whole model's parameter names in order and its tied names (`{name: the name
    single's optimizer uses}`), the qkv tensors tensor parallel regrouped, and the pipeline this
    process runs (None: the whole model). Each method takes the plain model (DDP's unwrapped)."""

    parameter_order: tuple[str, ...] = ()
    tied: dict[str, str] = field(default_factory=dict)
    row_orders: dict[str, RowOrder] = field(default_factory=dict)
    pipeline: PipelineRun | None = None

    @classmethod
    def of(cls, model: nn.Module) -> SingleLayoutCheckpoints:
        """Those of plain `model`, before any wrapper renames or splits it (no regrouped rows,
        no pipeline yet)."""
        return cls(tuple(name for name, _ in model.named_parameters()), tied_keys(model))

    def trains(self, name: str) -> bool:
        """Whether this process trains (and holds) the state_dict entry `name`: under pp, only
        the entries of its stages (a tied tensor's on each rank whose stages use it)."""
        if self.pipeline is None:
            return True
        return name in self.pipeline.stages.held

    def single_name(self, name: str) -> str:
        """The name single's optimizer state has for parameter `name`: under pp, a rank holding
        a tied tensor's later use (GPT's head) alone keeps its optimizer state under the first
        name (the embedding's), which every rank holding a copy saves and reads alike."""
        return self.tied.get(name, name)

    def as_saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """The entries this process trains, each in single's layout (`in_single_rows`), and the
        optimizer's groups as single's (`single_groups`), if the state has an optimizer."""
        saved = {
            "model": {
                name: self.in_single_rows(name, value)
                for name, value in state["model"].items()
                if self.trains(name)
            }
        }
        if "optimizer" in state:
            optimizer_state = state["optimizer"]
            saved["optimizer"] = {
                "state": {
                    self.single_name(name): {
                        key: self.in_single_rows(name, value) for key, value in entries.items()
                    }
                    for name, entries in optimizer_state["state"].items()
                    if self.trains(name)
                },
                "param_groups": self.single_groups(optimizer_state["param_groups"]),
            }
        return saved

    def single_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (parameters by name) as single's: under pp, each
        group's parameters on every pp rank, in the model's order (a collective of the pp
        ranks), copied: DCP loads into them, and the optimizer keeps its own."""
        if self.pipeline is None:
            return groups
        every = self.pipeline.every_rank([group["params"] for group in groups])
        return [
            {**group, "params": [n for n in self.parameter_order if any(n in p[g] for p in every)]}
            for g, group in enumerate(groups)
        ]

    def in_single_rows(self, name: str, value: Any) -> Any:
        """A regrouped qkv tensor's local shard (a contiguous block of regrouped rows) as the
        rows of single's tensor it holds; a DTensor of partial sums `summed`, as DCP saves no
        partial values; any other value as it is."""
        if not isinstance(value, DTensor):
            return value
        value = summed(value)
        if name not in self.row_orders:
            return value
        if not dcp_places_rows():  # the whole tensor, every rank of its mesh alike (DCP: once)
            return single_layout(name, full_tensor(value), self.row_orders)
        rows, corner = self.local_rows(name, value)
        dim = self.row_orders[name].dim
        return rows_placed(value.to_local(), rows, value.shape, dim, corner)

    def local_rows(self, name: str, value: DTensor) -> tuple[list[int], list[int]]:
        """The rows (along the regrouped dimension) of single's tensor `name` that this rank's
        shard of a regrouped qkv tensor holds, in the shard's order, and the shard's offsets in
        single's tensor (in the other dimensions, where FSDP also shards it, its own)."""
        (chunk,) = value.__create_chunk_list__()  # where this shard lies, in regrouped rows
        dim = self.row_orders[name].dim
        start, count = chunk.offsets[dim], chunk.sizes[dim]
        return self.row_orders[name].order[start : start + count].tolist(), list(chunk.offsets)

    def place_loaded(self, state: dict[str, Any], saved: dict[str, Any]) -> None:
        """Where DCP cannot place the rows itself (`dcp_places_rows`), each regrouped qkv
        tensor was read whole, in single's layout: this rank's rows go into its shard."""
        if dcp_places_rows():
            return
        model, optimizer = saved["model"], saved["optimizer"]["state"]
        read = [
            (name, value, model[name]) for name, value in state["model"].items() if name in model
        ]
        read += [
            (name, value, optimizer[name][key])
            for name, entries in state["optimizer"]["state"].items()
            if name in optimizer
            for key, value in entries.items()
        ]
        for name, value, whole in read:
            if name in self.row_orders and isinstance(value, DTensor):
                local = value.to_local()
                rows, corner = self.local_rows(name, value)
                dim = self.row_orders[name].dim
                shard = whole.index_select(dim, torch.tensor(rows))
                for d, (start, size) in enumerate(zip(corner, local.shape, strict=True)):
                    if d != dim:  # FSDP's share of the other dimensions
                        shard = shard.narrow(d, start, size)
                local.copy_(shard.to(local.device))

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Single's state_dict: under pp, the entries of blocks this rank does not hold (meta) are
        filled from the ranks that do (`PipelineRun.gathered`)."""
        state = {
            name: single_layout(name, full_tensor(value), self.row_orders)
            if self.trains(name)
            else value
            for name, value in model.state_dict().items()
        }
        return self.pipeline.gathered(state) if self.pipeline else state

    def single_order(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """The parameters in single's optimizer order, which numbers its state: each group's
        parameters in the model's order (`single_groups`), group after group."""
        names = iter(self.optimized_names(model, optimizer))
        groups = [
            {"params": [next(names) for _ in group["params"]]} for group in optimizer.param_groups
        ]
        return [name for group in self.single_groups(groups) for name in group["params"]]

    def optimized_names(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
        """Single's name of each of `optimizer`'s parameters (`single_name`), in its order."""
        return [self.single_name(name) for name in parameter_names(model, optimizer)]

    def optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Single's format: state by single's parameter index, each tensor whole, in single's
        layout; under pp, every rank's (each optimizer holds its own stages' parameters)."""
        names = self.optimized_names(model, optimizer)
        state = optimizer.state_dict()
        state["state"] = {
            index: {
                key: single_layout(names[index], full_tensor(value), self.row_orders)
                if isinstance(value, torch.Tensor) and value.dim() > 0
                else value
                for key, value in entries.items()
            }
            for index, entries in state["state"].items()
        }
        single = {name: index for index, name in enumerate(self.single_order(model, optimizer))}
        state = renamed(state, {index: single[name] for index, name in enumerate(names)})
        return self.pipeline.merged(state) if self.pipeline else state

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Single's optimizer state: under pp, the entries of this rank's parameters only."""
        local = {name: index for index, name in enumerate(self.optimized_names(model, optimizer))}
        names = dict(enumerate(self.single_order(model, optimizer)))
        parameters = {
            self.single_name(name): parameter
            for name, parameter in model.named_parameters()
            if self.trains(name)
        }
        own = {index: name for index, name in names.items() if name in local}
        state = {
            "state": {
                local[own[index]]: {
                    key: like(parameters[own[index]], tp_layout(own[index], value, self.row_orders))
                    if isinstance(value, torch.Tensor) and value.dim() > 0
                    else value
                    for key, value in entries.items()
                }
                for index, entries in state["state"].items()
                if index in own
            },
            "param_groups": [
                # In this optimizer's order (a tied copy's, single's first, may be its last).
                {**group, "params": sorted(local[own[i]] for i in group["params"] if i in own)}
                for group in state["param_groups"]
            ],
        }
        optimizer.load_state_dict(state)
