"""Sharded (DCP) checkpoints of the mesh layouts (src/parallel/strategies/mesh.py) through the real
`train.py`: fsdp 2 x tp 2 and pp 2 save single's tensors in shards, which export as single's
state_dict and resume, resharded, under single, ddp, fsdp and pp; single's resume under fsdp 2 x
tp 2. Each resumed run ends as the uninterrupted single run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    TINY_TRANSFORMER_SGD,
    assert_goes_on_exactly,
    assert_same_training,
    checkpoint,
    parallel_config,
    sweep_runs,
)

from src.checkpoint.export import export
from src.components.models import Transformer
from src.parallel import build_strategy

# The transformer: its fused qkv rows are what tp regroups, its 4 blocks make 2 pp stages.
# Clipped, over two micro-steps: under fsdp_tp its layers are DTensors on two meshes.
WORKLOAD = (
    *TINY_TRANSFORMER_SGD,
    "trainer.accumulate=2",
    "trainer.grad_clip=0.05",
    "trainer.checkpoint_every=3",
)
RANKS = {"single": 1, "fsdp_tp": 4, "pp": 2}


def saved_runs() -> dict[str, Path]:
    """single (the uninterrupted reference), fsdp 2 x tp 2 and pp 2, each checkpointing sharded
    at steps 3 and 6 in one sweep; asynchronously, so that the resumes from step 3 show that DCP
    copied each rank's pieces before training went on."""
    runs = sweep_runs(
        *WORKLOAD,
        "trainer.checkpoint_format=sharded",
        "trainer.async_checkpoint=true",
        f"parallel={','.join(RANKS)}",
    )
    return {key.removeprefix("parallel="): run_dir for key, run_dir in runs.items()}


def resumed_runs(source: str, layouts: tuple[str, ...]) -> dict[str, Path]:
    """The `source` run's step-3 checkpoint resumed under each of `layouts`, in one sweep (each
    job in a folder of its own, logging steps 4 to 6); they save `full`, the format the sources
    did not."""
    resume = saved_runs()[source] / "checkpoints" / "step-000003"
    runs = sweep_runs(
        *WORKLOAD,
        f"trainer.resume={resume}",
        "trainer.checkpoint_format=full",
        f"parallel={','.join(layouts)}",
    )
    return {key.removeprefix("parallel="): run_dir for key, run_dir in runs.items()}


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", ["fsdp_tp", "pp"])
def test_a_mesh_layout_saves_shards_that_export_as_single_s_state_dict(layout, tmp_path):
    """Each rank writes its own shards (the pp ranks their own blocks); read whole, or
    exported, they are single's state_dict: its keys, its qkv row order, its values."""
    runs = saved_runs()
    saved = runs[layout] / "checkpoints" / "step-000006"
    assert len(list(saved.glob("*.distcp"))) == RANKS[layout]
    assert_same_training(runs["single"], runs[layout])

    export(runs[layout], tmp_path / "model.pt")

    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    model = Transformer(input_shape=(8,), num_classes=16, hidden=32, depth=2, heads=2)
    model.load_state_dict(exported)  # strict
    reference = checkpoint(runs["single"])["model"]
    assert list(exported) == list(reference)
    assert all((exported[key] - value).abs().max() < 1e-5 for key, value in reference.items())


@pytest.mark.equivalence
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["single", "ddp", "fsdp", "pp"])
def test_a_2d_sharded_checkpoint_resumes_exactly_as_another_layout(layout):
    """fsdp 2 x tp 2's shards, read by 1 process, by 2 replicas that each read them whole, by 2
    that shard them along another dimension, and by 2 pipeline ranks that take their own blocks
    each."""
    run_dir = resumed_runs("fsdp_tp", ("single", "ddp", "fsdp", "pp"))[layout]
    assert_goes_on_exactly(saved_runs()["single"], run_dir, [4, 5, 6])


@pytest.mark.equivalence
@pytest.mark.timeout(600)
def test_a_single_sharded_checkpoint_resumes_exactly_under_tensor_parallel():
    """single's rows, loaded into each fsdp 2 x tp 2 rank's shard of the regrouped qkv rows (a
    quarter: tp's half, sharded again by FSDP); the full checkpoint the run then saves holds
    single's order again. (tp alone is the same code on a 1-D mesh: each shard's rows come from
    the DTensor's own offsets, `SingleLayoutCheckpoints.local_rows`.)"""
    (run_dir,) = resumed_runs("single", ("fsdp_tp",)).values()
    assert_goes_on_exactly(saved_runs()["single"], run_dir, [4, 5, 6])


@pytest.mark.parametrize(
    "option, degrees, expected",
    [
        ("tp", {}, "sharded"),
        ("pp", {}, "sharded"),
        ("fsdp_tp", {}, "sharded"),
        ("tp", {"tp": 1, "dp_replicate": -1}, "full"),  # replicas only: each holds the model
    ],
    ids=["tp", "pp", "fsdp_tp", "replicas"],
)
def test_auto_is_sharded_where_no_rank_holds_the_whole_model(option, degrees, expected):
    strategy = build_strategy(parallel_config(option, **degrees), "cpu")
    assert strategy.default_checkpoint_format == expected
