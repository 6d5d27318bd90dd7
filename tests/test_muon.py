"""`optimizer=muon`: torch's Muon over the blocks' 2-D weight matrices and AdamW over the rest, as
one optimizer (src/components/muon.py); and the layouts that split a matrix (fsdp, tp, both) or
the model (pp) train under it as `single` does, through the real `train.py`."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import TINY, assert_same_losses, assert_same_weights, strategy_runs
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from src.components.models import MLP
from src.components.optimizer import block_matrices, build_optimizer

# Three steps at full rate (lr 0.02: with Kimi's per-matrix scale an update of about 4e-3 RMS a
# step, so the weights move far past the tolerance), no evaluation.
MUON = (
    *(o for o in TINY if not o.startswith(("trainer.max_steps=", "trainer.eval_every="))),
    "trainer.max_steps=3",
    "trainer.eval_every=0",
    "trainer.test=false",
    "optimizer=muon",
    "optimizer.warmup_steps=0",
    "optimizer.lr=0.02",
)
# fsdp x2 and tp x2 split each matrix over 2 ranks, fsdp_tp over 4 (dp_shard 2 x tp 2), pp x2
# keeps whole matrices on each stage.
LAYOUTS = ("fsdp", "tp", "fsdp_tp", "pp")
# Every rank orthogonalises the whole matrix as single does, so only the gradients' last-bit
# differences (another order of summation: fsdp's reduce-scatter, tp's split matmuls) reach
# torch's Newton-Schulz iteration, which runs in bf16: such a difference can flip the bf16
# rounding of an element there and move that element's update by one bf16 ulp (2^-8 of it: at
# most 5e-5 for these updates of up to about 1e-2). 1e-4 bounds two such flips (seen: weights
# 3e-8 apart, losses 2e-7).
WEIGHT_TOLERANCE = 1e-4


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_trains_like_single_under_every_layout(layout):
    runs = strategy_runs(*MUON, strategies=LAYOUTS)
    assert_same_losses(runs["single"], runs[layout])
    assert_same_weights(runs["single"], runs[layout], WEIGHT_TOLERANCE)


def test_muon_steps_as_torchs_muon_and_adamw_and_goes_on_from_its_state_dict(compose_config):
    """On whole tensors the blocks' matrices step exactly as torch.optim.Muon steps them (which
    `WholeMatrixMuon` repeats, with torch's private Newton-Schulz and learning-rate functions),
    the rest as torch's AdamW; its state, loaded into a new one as a sharded checkpoint's is,
    goes on alike (both parts step from the loaded groups and state, AdamW's empty group of
    matrices outside the blocks too)."""
    settings = compose_config("optimizer=muon", "optimizer.lr=0.02").optimizer
    torch.manual_seed(0)
    model = MLP((8,), 3, hidden=8, depth=2)
    twin = copy.deepcopy(model)
    ours = build_optimizer(settings, model.parameters(), block_matrices(model))
    matrices = block_matrices(twin)
    assert [tuple(p.shape) for p in matrices] == [(8, 8), (8, 8), (3, 8)]  # the head is a block
    others = [p for p in twin.parameters() if all(p is not m for m in matrices)]
    common = {"lr": settings.lr, "weight_decay": settings.weight_decay}
    muon = torch.optim.Muon(matrices, **common, adjust_lr_fn=settings.adjust_lr_fn)
    adamw = torch.optim.AdamW([{"params": others, "weight_decay": 0.0}], **common)
    inputs = torch.randn(3, 4, 8)

    def step(net: torch.nn.Module, *optimizers: torch.optim.Optimizer, at: int) -> None:
        net(inputs[at]).square().sum().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    for at in range(2):
        step(model, ours, at=at)
        step(twin, muon, adamw, at=at)
    torch.testing.assert_close(model.state_dict(), twin.state_dict(), rtol=0, atol=0)
    resumed_model = copy.deepcopy(model)
    resumed = build_optimizer(settings, resumed_model.parameters(), block_matrices(resumed_model))
    # Through DCP's state dicts, as sharded checkpoints save and load it (copied, as from files).
    saved = copy.deepcopy(get_optimizer_state_dict(model, ours))
    set_optimizer_state_dict(resumed_model, resumed, saved)
    step(model, ours, at=2)
    step(resumed_model, resumed, at=2)
    torch.testing.assert_close(model.state_dict(), resumed_model.state_dict(), rtol=0, atol=0)
