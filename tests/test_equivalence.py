"""Every strategy trains like `single`, whatever CPU runs the tests.

Weights are compared under SGD (helpers.SGD says why not Adam), to float tolerance, also when the
other run used another CPU's kernels. Runs with the default optimizer, AdamW, are compared by
their losses. The strategies' own files hold the detailed equivalence tests; run them all on other
kernels with `ATEN_CPU_CAPABILITY=default python -m pytest -m equivalence`.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
from helpers import (
    STRATEGIES,
    TINY,
    TINY_TRANSFORMER_SGD,
    assert_same_losses,
    assert_same_training,
    reference_run,
    run_sweep,
    run_train,
    summary,
)

SWEPT = list(STRATEGIES)  # job i of the sweep trains SWEPT[i]


@pytest.fixture(scope="module")
def every_strategy(tmp_path_factory) -> Path:
    """One sweep over the strategies as their `conf/parallel/` options ship (2 devices; hybrid 2
    pipelines of 2), with the default optimizer. One process runs them all (ddp, hybrid and fsdp
    start their ranks from it): half the time of a `train.py` each."""
    sweep_dir = tmp_path_factory.mktemp("every-strategy")
    run_sweep(*TINY, f"parallel={','.join(SWEPT)}", sweep_dir=sweep_dir)
    return sweep_dir


@pytest.mark.smoke
@pytest.mark.equivalence
@pytest.mark.parametrize("strategy", SWEPT)
def test_each_strategy_trains_like_single_with_the_default_optimizer(every_strategy, strategy):
    run_dir = every_strategy / str(SWEPT.index(strategy))
    assert (run_dir / "summary.json").exists(), (run_dir / "train.log").read_text()[-3000:]
    assert summary(run_dir)["strategy"] == strategy
    assert_same_losses(every_strategy / str(SWEPT.index("single")), run_dir)


# ATen's vectorised kernels come in one build per instruction set and are picked at start-up;
# matrix products go to MKL, which picks its own. Where they differ, sums round differently.
KERNELS = {
    "default": {"ATEN_CPU_CAPABILITY": "default"},  # no SIMD at all
    # An AVX2 CPU without AVX-512 (such as AMD EPYC before Zen 4): ATen's and MKL's AVX2 code.
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.mark.equivalence
@pytest.mark.parametrize(
    "kernels",
    [
        "default",
        pytest.param("avx2", marks=pytest.mark.skipif(not X86, reason="AVX2 is x86 only")),
    ],
)
def test_sgd_weights_match_single_on_other_cpu_kernels(tmp_path, kernels):
    """fsdp training the transformer on other kernels ends with the weights of `single` on this
    CPU's own: the workload that drifted past 1e-5 under AdamW on an AVX2 CPU. The run says
    which kernels it ran (summary.json's cpu_kernels)."""
    fsdp = ("parallel=fsdp", "parallel.devices=2")
    run_train(*TINY_TRANSFORMER_SGD, *fsdp, run_dir=tmp_path, env=KERNELS[kernels])
    assert summary(tmp_path)["cpu_kernels"] == kernels.upper()
    assert_same_training(reference_run(*TINY_TRANSFORMER_SGD), tmp_path)
