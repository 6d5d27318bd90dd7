"""Expert parallel (`parallel.ep`, src/parallel/ep/) on `model=moe` through the real
`train.py`: ep 2 (top 1 and top 2), ep 4 (top 1) and ep 2 of dp_shard 4 (top 2) against
`single` under SGD in fp32 (losses, aux losses, final weights), each one's sharded checkpoint
resumed exactly under another, ep 4 at top 2 from one; each expert's tokens under ep (gloo
processes) and the one-line refusals. CPU-seconds (all processes), this file alone: 80 to 84,
of which the single and ep 2 sweep 21, each 4-process job 14, the tokens 3, pytest's start 7"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_goes_on_exactly,
    assert_same_training,
    forked_ranks,
    metrics,
    parallel_config,
    resumed_sweep_runs,
    sweep_runs,
)
from slurm_cluster import free_port
from test_moe import MOE_SGD

from src.components.models import GPT
from src.components.moe import MoEGPT
from src.config.base import ConfigError
from src.parallel import build_strategy
from src.parallel.ep.apply import moe_layers
from src.runtime.ranks import Ranks

# Accumulation and clipping too: clipping takes the norm of the dense and the experts'
# gradients, DTensors on two meshes.
WORKLOAD = (
    *MOE_SGD,
    "trainer.accumulate=2",
    "trainer.grad_clip=0.05",
    "trainer.checkpoint_every=3",
)


def two_process_runs() -> dict[str, Path]:
    """single and ep 2 (the preset: dp_shard 2, all of it ep), top 1 and top 2: one sweep. ep
    saves sharded checkpoints at steps 3 and 6."""
    return sweep_runs(*WORKLOAD, "model.top_k=1,2", "parallel=single,ep")


def ep_4_run() -> Path:
    """ep 4 (the preset on 4 processes), top 1. At top 2 ep 4 trains from a checkpoint only
    (`test_each_ep_layout_resumes_another_s_sharded_checkpoint_exactly`): its first steps run
    the code of these, which takes top_k as a number, as ep 2's runs do at both."""
    (run_dir,) = sweep_runs(
        *WORKLOAD, "model.top_k=1", "parallel=ep", "parallel.devices=4"
    ).values()
    return run_dir


def ep_2_of_4_run() -> Path:
    """ep 2 of dp_shard 4, top 2 (top 1's routing is ep 2's and ep 4's): a sweep of its own, as
    crossing it with top 1 and 2 would cost a 4-process run more than a `train.py` start."""
    layout = ("parallel=ep", "parallel.devices=4", "parallel.ep=2")
    (run_dir,) = sweep_runs(*WORKLOAD, "model.top_k=2", *layout).values()
    return run_dir


def assert_same_aux_losses(reference: Path, other: Path, after_step: int = 0) -> None:
    """`other` logs `reference`'s train and val aux losses of the steps after `after_step` (the
    checkpoint it resumed)."""
    for logged in ("train/aux_loss", "val/aux_loss"):
        rows = metrics(reference)
        expected = [row[logged] for row in rows if logged in row and row["step"] > after_step]
        actual = [row[logged] for row in metrics(other) if logged in row]
        assert actual == pytest.approx(expected, abs=1e-6) and expected


@pytest.mark.equivalence
@pytest.mark.parametrize(
    "ep, top_k", [("ep2", 1), ("ep2", 2), ("ep4", 1), ("ep2 of dp_shard 4", 2)]
)
def test_expert_parallel_trains_exactly_like_single(ep, top_k):
    single = two_process_runs()[f"model.top_k={top_k} parallel=single"]
    if ep == "ep2":
        run = two_process_runs()[f"model.top_k={top_k} parallel=ep"]
    elif ep == "ep4":
        run = ep_4_run()
    else:
        run = ep_2_of_4_run()
    assert_same_training(single, run)
    assert_same_aux_losses(single, run)


# The ep layouts, by their processes and ep degree (ep 4 on 2 processes is skipped).
EP_LAYOUTS = ("parallel.devices=2,4", "parallel.ep=2,4")
EP_2 = "parallel.devices=2 parallel.ep=2"
EP_2_OF_4 = "parallel.devices=4 parallel.ep=2"
EP_4 = "parallel.devices=4 parallel.ep=4"


def step_3_checkpoints() -> dict[str, Path]:
    """The step-3 checkpoint that each ep layout resumes: another's (ep 2's under ep 2 of
    dp_shard 4, and that one's under ep 2 and ep 4). ep 4's are read whole by the checks."""
    saved = {
        EP_2: ep_2_of_4_run(),
        EP_2_OF_4: two_process_runs()["model.top_k=2 parallel=ep"],
        EP_4: ep_2_of_4_run(),
    }
    return {layout: run_dir / "checkpoints" / "step-000003" for layout, run_dir in saved.items()}


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", [EP_2, EP_2_OF_4, EP_4])
def test_each_ep_layout_resumes_another_s_sharded_checkpoint_exactly(layout):
    """Each checkpoint (DCP shards, the experts split on dim 0) holds exactly the state, and each
    layout restores it into its own shards: one sweep, each job logging single's losses and aux
    losses of steps 4 to 6 and ending at its weights (ep 4's, at top 2, as written to its own
    sharded checkpoint)."""
    saved = step_3_checkpoints()
    assert all(len(list(folder.glob("*.distcp"))) > 1 for folder in saved.values())
    resumed = resumed_sweep_runs(
        *WORKLOAD, "model.top_k=2", "parallel=ep", *EP_LAYOUTS, resume=saved
    )
    single = two_process_runs()["model.top_k=2 parallel=single"]
    assert_goes_on_exactly(single, resumed[layout], [4, 5, 6])
    assert_same_aux_losses(single, resumed[layout], after_step=3)


def kept_choices(model: torch.nn.Module) -> list[list[int]]:
    """A list that each MoE layer's forward fills with its experts' kept choices: the non-zero
    rows of the tokens grouped for them (under ep, this rank's experts')."""
    counts: list[list[int]] = []

    def count(_: torch.nn.Module, args: tuple[torch.Tensor]) -> None:
        counts.append(args[0].ne(0).any(-1).sum(1).tolist())

    for block in list(model)[1:-1]:
        block.moe.experts.register_forward_pre_hook(count)
    return counts


def each_expert_s_tokens_under_ep(rank: int, port: int) -> None:
    """Rank `rank` of ep 2 on its half of a batch: each of its experts takes the tokens that
    single's takes from the whole batch (so drops and load are single's), and its samples'
    logits and aux loss are single's. Its experts are DTensors on FSDP's and ep's dimensions
    alone: no dp_replicate of size 1, over which DTensor would propagate their sharding too."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    ranks = Ranks(rank=rank, world_size=2, local_rank=rank, local_world_size=2)
    strategy = build_strategy(parallel_config("ep", devices=2), "cpu", "fp32", ranks)
    strategy.setup()
    settings = {"experts": 4, "top_k": 2, "capacity_factor": 0.75, "aux_loss_weight": 0.1}
    single, model = (torch.manual_seed(0) and MoEGPT((8,), 16, 2, 2, 16, **settings) for _ in "ab")
    tokens = torch.randint(16, (6, 8))
    single_counts = kept_choices(single)
    with torch.no_grad():
        expected = single(tokens)
    model = strategy.wrap(model)
    meshes = {
        parameter.device_mesh.mesh_dim_names
        for layer in moe_layers(model)
        for parameter in layer.experts.parameters()
    }
    assert meshes == {("dp_shard_mod_ep", "ep")}, meshes
    ep_counts = kept_choices(model)
    with torch.no_grad():
        logits, aux_loss = model(tokens[3 * rank : 3 * rank + 3])
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, ep_counts)
    for layer, counts in enumerate(single_counts):  # rank r holds experts 2r and 2r + 1
        assert gathered[0][layer] + gathered[1][layer] == counts, (layer, gathered)
    own = slice(3 * rank, 3 * rank + 3)
    torch.testing.assert_close(logits, expected[0][own], rtol=0, atol=1e-5)
    torch.testing.assert_close(aux_loss, expected[1][own], rtol=0, atol=1e-5)
    strategy.teardown()


@pytest.mark.equivalence
def test_each_expert_takes_single_s_tokens_under_ep():
    """2 gloo processes forked from the rank server, which has imported torch (9 s)."""
    forked_ranks(each_expert_s_tokens_under_ep, free_port())


def checked(settings: dict, model: torch.nn.Module | None = None) -> None:
    strategy = build_strategy(parallel_config("ep", **settings), "cpu")
    if model is not None:
        strategy.check_model(model, torch.zeros(2, 8, dtype=torch.long))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"devices": 4, "ep": 3}, "parallel.ep=3 must divide parallel.dp_shard=4"),
        ({"dp_shard": 1, "dp_replicate": 2, "ep": 2}, "DDP (parallel.dp_replicate alone) has none"),
        (
            {"devices": 4, "dp_shard": 2, "tp": 2, "ep": 2},
            "with parallel.tp, parallel.cp or parallel.pp",
        ),
        ({"ep": 0}, "parallel.ep must be at least 1, or -1"),
    ],
)
def test_an_ep_the_layout_cannot_lend_its_ranks_is_one_line(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        checked(settings)


def test_ep_over_a_model_without_experts_or_uneven_experts_is_one_line():
    with pytest.raises(ConfigError, match="this model has none; use model=moe"):
        checked({"devices": 2}, GPT((8,), 16, 1, 2, 16))
    moe = MoEGPT((8,), 16, 1, 2, 16, experts=6, top_k=1, capacity_factor=1, aux_loss_weight=0)
    with pytest.raises(ConfigError, match="model.experts=6 does not split into parallel.ep=4"):
        checked({"devices": 4}, moe)
