"""`parallel=hybrid` (DDP over pipelines) through the real `train.py`: gloo processes of CPU
stages here, NCCL and a pair of GPUs per process where there are 4 GPUs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY_SGD,
    TINY_TRANSFORMER_SGD,
    assert_same_optimizer_state,
    assert_same_training,
    checkpoint,
    metrics,
    needs_gpus,
    parallel_config,
    pretend_gpus,
    reference_run,
    run_train,
    summary,
)

from src.components.models import MLP
from src.config.base import ConfigError
from src.parallel import build_strategy
from src.runtime.ranks import Ranks

HYBRID = ("parallel=hybrid", "parallel.devices=4", "parallel.stages=2")
# Accumulation too, so that DDP's no_sync runs over the pipeline: 2 micro-steps of 12 samples,
# 6 per process, 2 micro-batches of 3 each through its stages.
MLP_WORKLOAD = (*TINY_SGD, "trainer.accumulate=2")
TINY_MLP = {"input_shape": (32,), "num_classes": 10, "hidden": 32, "depth": 3}


def log_lines(run_dir: Path) -> list[str]:
    return [line for line in (run_dir / "train.log").read_text().splitlines() if line[:1] == "["]


def val_losses(run_dir: Path) -> torch.Tensor:
    return torch.tensor([row["val/loss"] for row in metrics(run_dir) if "val/loss" in row])


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("hybrid-mlp")
    run_train(*MLP_WORKLOAD, *HYBRID, "parallel.microbatches=2", run_dir=run_dir)
    return run_dir


@pytest.mark.equivalence
def test_hybrid_trains_the_mlp_exactly_like_single(mlp_run):
    reference = reference_run(*MLP_WORKLOAD)
    assert_same_training(reference, mlp_run)
    torch.testing.assert_close(val_losses(mlp_run), val_losses(reference), rtol=0, atol=1e-5)

    result = summary(mlp_run)
    assert result["strategy"] == "hybrid" and result["world_size"] == 2
    assert result["stages"] == 2 and result["split_points"] == [2]
    assert result["microbatches"] == 2 and result["bubble_fraction"] == pytest.approx(1 / 3)
    assert result["memory_devices"] == ["cpu:rank0", "cpu:rank1"]
    lines = log_lines(mlp_run)
    for rank in (0, 1):
        assert any(
            re.match(rf"\[rank{rank}\].*pipeline: 2 stages on cpu, cpu, .*bubble", line)
            for line in lines
        )
    assert sum("step 6/6" in line for line in lines) == 1, "rank 0 alone reports"


@pytest.mark.equivalence
def test_hybrid_checkpoint_loads_into_single(mlp_run):
    single_model = MLP(**TINY_MLP)
    single_model.load_state_dict(checkpoint(mlp_run)["model"])  # strict: single's keys exactly
    # The optimizer was built on the plain model, so its state has single's layout too.
    assert_same_optimizer_state(reference_run(*MLP_WORKLOAD), mlp_run)


@pytest.mark.equivalence
def test_hybrid_trains_the_transformer_exactly_like_single(tmp_path):
    run_train(*TINY_TRANSFORMER_SGD, *HYBRID, "parallel.microbatches=1", run_dir=tmp_path)
    assert_same_training(reference_run(*TINY_TRANSFORMER_SGD), tmp_path)
    assert summary(tmp_path)["bubble_fraction"] == pytest.approx(1 / 2)


def test_hybrid_trains_blocks_that_hand_on_tuples_dicts_and_lists_like_single(tmp_path):
    # Stages cut at block 2, where block 1 hands on a dict of tensors.
    workload = (*TINY_SGD, "model._target_=tests.odd_models.StructuredMLP")
    run_train(*workload, *HYBRID, "parallel.microbatches=2", run_dir=tmp_path)
    assert_same_training(reference_run(*workload), tmp_path)
    assert summary(tmp_path)["split_points"] == [2]


def test_processes_and_their_gpus_follow_from_devices_and_stages(monkeypatch):
    config = parallel_config("hybrid", devices=8, stages=2, nodes=2, master_port=29500)
    strategy = build_strategy(config, "cpu")
    assert (strategy.processes_per_node, strategy.world_size) == (4, 8)
    # Which GPUs process p drives needs no GPU to work out: p * stages .. p * stages + stages - 1.
    strategy.device_type, strategy.local_rank = "cuda", 3
    pretend_gpus(monkeypatch, 8)
    assert strategy.local_devices() == [torch.device("cuda", 6), torch.device("cuda", 7)]
    # Under `srun --gpus-per-task=2` each process sees its own pair only, and needs no more.
    pretend_gpus(monkeypatch, 2)
    assert strategy.local_devices() == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ConfigError, match=r"parallel\.devices=8 but only 2 GPU"):
        strategy.check_visible_gpus()  # a job started here: it needs every GPU
    strategy.ranks = Ranks(rank=3, world_size=8, local_rank=3, local_world_size=4)
    strategy.check_visible_gpus()
    pretend_gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"drives 2 GPU\(s\) but this one sees 1"):
        strategy.check_visible_gpus()


@pytest.mark.cuda
@pytest.mark.equivalence
@needs_gpus(4)
def test_each_process_drives_its_own_pair_of_gpus(tmp_path):
    gpu = ("trainer.accelerator=cuda",)
    run_train(*TINY_SGD, *HYBRID, "parallel.microbatches=2", *gpu, run_dir=tmp_path)
    assert_same_training(reference_run(*TINY_SGD, *gpu), tmp_path)

    result = summary(tmp_path)
    assert result["memory_devices"] == [f"cuda:{i}" for i in range(4)]
    assert all(mb > 0 for mb in result["peak_memory_mb"]), "a GPU that held no stage"
    lines = log_lines(tmp_path)
    assert any(re.match(r"\[rank0\].*pipeline: 2 stages on cuda:0, cuda:1,", x) for x in lines)
    assert any(re.match(r"\[rank1\].*pipeline: 2 stages on cuda:2, cuda:3,", x) for x in lines)
    assert any(re.match(r"\[rank1\].*cuda:2, cuda:3, nccl", x) for x in lines)
