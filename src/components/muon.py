"""`optimizer=muon`: torch's Muon over the blocks' 2-D weight matrices, AdamW over the rest, as
one torch optimizer, exact under every layout.

Muon orthogonalises each matrix's momentum (Newton-Schulz iterations on the whole matrix), which
no shard can do alone. Where a matrix is a DTensor (fsdp's shards, tp's splits, both on fsdp_tp's
2-D mesh) every rank gathers it (one all-gather of the update per matrix and step), orthogonalises
the whole matrix as single does, and keeps its own shard of the result: the same update as
single's, for one whole matrix's transient memory at a time. The momentum stays sharded (its
update is element-wise). Pipeline stages and replicas hold whole matrices already.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

# torch's own Newton-Schulz iteration and per-matrix learning rate (torch.optim.Muon's step
# applies them to whole tensors only); tests/test_muon.py fails if they change.
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from src.components.optimizer import BLOCK_MATRICES, adamw
from src.config.base import ConfigError


def muon(
    params: list[dict[str, Any]],
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    adjust_lr_fn: str,
    betas: Sequence[float],
    eps: float,
) -> MuonWithAdamW:
    """Muon over the parameter group marked `block_matrices` (`optimizer.block_matrices_apart`),
    AdamW over the others, with one learning rate and weight decay."""
    matrices = [group for group in params if group.get(BLOCK_MATRICES)]
    rest = [group for group in params if not group.get(BLOCK_MATRICES)]
    if not matrices:
        raise ConfigError(
            "optimizer: src.components.muon.muon steps the blocks' matrices apart; choose "
            "optimizer=muon, or set optimizer.block_matrices_apart=true"
        )
    whole = WholeMatrixMuon(
        matrices,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )
    return MuonWithAdamW(whole, adamw(rest, betas, lr=lr, weight_decay=weight_decay, eps=eps))


class WholeMatrixMuon(torch.optim.Muon):
    """torch.optim.Muon whose parameters may be DTensors: its step is torch's
    (`_single_tensor_muon`, repeated here) with each matrix's update orthogonalised whole
    (`orthogonalised`); the same arithmetic on whole tensors."""

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            momenta: list[torch.Tensor] = []
            self._init_group(group, params, grads, momenta)
            lr, beta = group["lr"], group["momentum"]
            for param, grad, momentum in zip(params, grads, momenta, strict=True):
                momentum.lerp_(grad, 1 - beta)
                update = grad.lerp(momentum, beta) if group["nesterov"] else momentum
                update = orthogonalised(update, param, group)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))


def orthogonalised(update: torch.Tensor, param: torch.Tensor, group: dict) -> torch.Tensor:
    """torch's Newton-Schulz orthogonalisation of the whole matrix `update`: a DTensor's
    gathered first, and of the result the shard `param` holds (each rank keeps its own, without
    communication)."""
    whole = update.full_tensor() if isinstance(update, DTensor) else update
    result = _zeropower_via_newtonschulz(
        whole, group["ns_coefficients"], group["ns_steps"], group["eps"]
    )
    if not isinstance(param, DTensor):
        return result
    return distribute_tensor(result, param.device_mesh, param.placements, src_data_rank=None)


class MuonWithAdamW(torch.optim.Optimizer):
    """Two torch optimizers as one: its parameter groups are theirs (Muon's first) and its state
    their shared state, so that the loop's learning rate, clipping, loss scaling, checkpoints in
    single's format and their loading see one optimizer."""

    # Its step's temporaries are whole matrices on every rank (`orthogonalised`): the planner
    # does not split them with the state (src/planning/memory_trace.py).
    steps_whole_matrices = True

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.parts = (muon, adamw)
        super().__init__([*muon.param_groups, *adamw.param_groups], {})
        self.share_groups_and_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # load_state_dict's new groups and state: the parts' too
        self.share_groups_and_state()

    def share_groups_and_state(self) -> None:
        """Each part's groups are its own of this optimizer's, its state this optimizer's. A
        group without its settings takes its part's defaults, the settings it was built with:
        DCP's loading (`set_optimizer_state_dict`, sharded checkpoints) gives an empty group
        that is not the last none (torch 2.14; AdamW's group of the matrices outside the blocks
        is empty where the head is a block, as an nn.Sequential's)."""
        groups = iter(self.param_groups)
        for part in self.parts:
            own = [next(groups) for _ in part.param_groups]
            for group in own:
                for key, value in part.defaults.items():
                    group.setdefault(key, value)
            part.__setstate__({"state": self.state, "param_groups": own})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for part in self.parts:
            part.step()
