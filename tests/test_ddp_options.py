"""DistributedDataParallel's own options, which torch's error messages tell users to set:
each one reaches DDP (under ddp and hybrid), and training stays `single`'s."""

from __future__ import annotations

import pytest
from helpers import TINY_SGD, assert_same_training, parallel_config, reference_run, run_train

import src.parallel.dp_replicate.apply
from src.components.models import MLP
from src.parallel import build_strategy

UNUSED = ("model._target_=tests.odd_models.UnusedParameterMLP",)
DDP = ("parallel=ddp", "parallel.devices=2")
OPTIONS = {
    "find_unused_parameters": True,
    "static_graph": True,
    "gradient_as_bucket_view": True,
    "bucket_cap_mb": 1.5,
}


class RecordingDDP:
    def __init__(self, module, device_ids=None, **options):
        self.module, self.options = module, options


@pytest.mark.parametrize("option", ["ddp", "hybrid"])
def test_each_option_reaches_distributed_data_parallel(monkeypatch, option):
    monkeypatch.setattr(src.parallel.dp_replicate.apply, "DistributedDataParallel", RecordingDDP)
    strategy = build_strategy(parallel_config(option, **OPTIONS), "cpu")
    replica = strategy.replicate(MLP(input_shape=(4,), num_classes=2, hidden=4, depth=1), None)
    assert OPTIONS.items() <= replica.options.items()


def test_torchs_bucket_size_is_kept_unless_set(monkeypatch):
    monkeypatch.setattr(src.parallel.dp_replicate.apply, "DistributedDataParallel", RecordingDDP)
    replica = build_strategy(parallel_config("ddp"), "cpu").replicate(MLP((4,), 2, 4, 1), None)
    assert "bucket_cap_mb" not in replica.options


def test_a_model_with_an_unused_parameter_trains_with_find_unused_parameters(tmp_path):
    """Without the option DDP stops at the second step, telling the user to set
    find_unused_parameters=True: now a setting they can follow."""
    workload = (*TINY_SGD, *UNUSED, "trainer.max_steps=3", "trainer.eval_every=0")
    run_train(*workload, *DDP, "parallel.find_unused_parameters=true", run_dir=tmp_path)
    assert_same_training(reference_run(*workload), tmp_path)


def test_static_graph_bucket_views_and_small_buckets_train_as_single(tmp_path):
    options = (
        "parallel.static_graph=true",
        "parallel.gradient_as_bucket_view=true",
        "parallel.bucket_cap_mb=0.001",
    )
    run_train(*TINY_SGD, *DDP, *options, run_dir=tmp_path)
    assert_same_training(reference_run(*TINY_SGD), tmp_path)
