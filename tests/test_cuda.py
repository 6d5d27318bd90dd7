"""The default run and every strategy that fits on one GPU, on a real GPU (skipped without one).

The first try on an H200 crashed `python train.py` and every in-process strategy before step 1:
`torch.cuda.reset_peak_memory_stats` fails on a process that has not initialised CUDA yet."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, run_train, summary

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_default_run_trains_on_the_gpu(tmp_path):
    # `auto`, the default, said explicitly: the test runner pins the CPU otherwise.
    run_train("trainer.accelerator=auto", "trainer.max_steps=20", "logger=none", run_dir=tmp_path)
    result = summary(tmp_path)
    assert result["memory_devices"] == ["cuda:0"] and result["peak_memory_mb"][0] > 0
    assert result["matmul_precision"] == "high"  # TF32 unless asked otherwise


@pytest.mark.parametrize("strategy", ["single", "dp", "dp_criterion", "model_parallel"])
def test_in_process_strategies_run_on_one_gpu(tmp_path, strategy):
    gpu = ("trainer.accelerator=cuda", f"parallel={strategy}", "parallel.devices=1")
    run_train(*TINY, *gpu, run_dir=tmp_path)
    assert summary(tmp_path)["memory_devices"] == ["cuda:0"]
