"""The default run and every strategy that fits on one GPU, on a real GPU (skipped without one).

The first try on an H200 crashed `python train.py` and every in-process strategy before step 1:
`torch.cuda.reset_peak_memory_stats` fails on a process that has not initialised CUDA yet."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, assert_same_training, run_train, summary

from src.planning.planner import plan_all
from src.planning.plans import MB

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


# Wide enough (784-1024-1024-1024-10, 3 M parameters) that the state offloading moves, 36 MB of
# parameters, gradients and SGD's momentum, stands out of the allocator's own granularity.
OFFLOAD = (
    *(override for override in TINY if not override.startswith("model.")),
    *("model.hidden=1024", "model.depth=3"),
    *("optimizer=sgd", "optimizer.warmup_steps=0"),
    *("trainer.accelerator=cuda", "trainer.matmul_precision=highest", "parallel.devices=1"),
)


def test_fsdp_offload_trains_like_single_and_lowers_the_device_peak_as_planned(
    tmp_path, compose_config
):
    """parallel.offload=cpu: single's weights, and the device peak (the allocator's) lower by
    what the planner moves to the host, within 20%. Not yet run on a GPU (written on a machine
    without one)."""
    runs = {name: tmp_path / name for name in ("single", "kept", "offloaded")}
    layouts = {
        "single": ("parallel=single",),
        "kept": ("parallel=fsdp",),
        "offloaded": ("parallel=fsdp", "parallel.offload=cpu"),
    }
    for name, layout in layouts.items():
        run_train(*OFFLOAD, *layout, run_dir=runs[name])
    assert_same_training(runs["single"], runs["offloaded"])
    kept, offloaded = (summary(runs[name])["peak_memory_mb"][0] for name in ("kept", "offloaded"))
    plans = [
        plan_all(cfg, [cfg.parallel])[0]
        for cfg in (compose_config(*OFFLOAD, *layouts[name]) for name in ("kept", "offloaded"))
    ]
    planned_drop = (plans[0].needed - plans[1].needed) / MB
    assert kept - offloaded == pytest.approx(planned_drop, rel=0.2)
