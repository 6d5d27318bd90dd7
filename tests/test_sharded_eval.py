"""Evaluation over validation shards that do not split evenly over the ranks, through the real
`train.py`: every rank runs as many forward passes (fsdp's gather parameters in each one), and
the figures are `single`'s."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, metrics, reference_run, run_train

# 61 validation samples: 31 on rank 0, 30 on rank 1.
UNEVEN = (*TINY, "data.num_samples=610", "trainer.accelerator=cpu")


def val_figures(run_dir) -> torch.Tensor:
    rows = [row for row in metrics(run_dir) if "val/loss" in row]
    return torch.tensor([[row["val/loss"], row["val/accuracy"]] for row in rows])


@pytest.mark.parametrize(
    "strategy, eval_batch",
    [
        # 10 per rank and batch: rank 0 runs 4 batches, rank 1 3 and a padding one.
        (("parallel=fsdp", "parallel.devices=2"), 20),
        # One sample per rank and batch: 31 forwards against 30.
        (("parallel=ddp", "parallel.devices=2"), 2),
        # 30 per rank and batch, in 2 micro-batches: the padding batch has 1 sample.
        (("parallel=hybrid", "parallel.devices=4", "parallel.microbatches=2"), 60),
    ],
    ids=["fsdp", "ddp", "hybrid"],
)
def test_uneven_validation_shards_give_single_s_figures(tmp_path, strategy, eval_batch):
    workload = (*UNEVEN, f"trainer.eval_batch_size={eval_batch}")
    run_train(*workload, *strategy, "parallel.timeout_s=30", run_dir=tmp_path, timeout=150)

    expected = val_figures(reference_run(*UNEVEN))
    assert len(expected) == 2
    torch.testing.assert_close(val_figures(tmp_path), expected, rtol=0, atol=1e-5)
