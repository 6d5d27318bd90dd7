"""Checkpoints written before ddp, fsdp and hybrid became layouts of the one mesh (main at
4369e69, `tests/fixtures/checkpoints_4369e69/README.md`) resume under today's presets and end
where an uninterrupted `single` run of the same config ends.

About 8 s per case on 2 CPU cores (two processes, 3 steps), plus the shared `single` run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import TINY_SGD, checkpoint, reference_run, run_train, train_losses

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints_4369e69"


@pytest.mark.equivalence
@pytest.mark.parametrize(
    ("written", "strategy"),
    [("ddp", "parallel=ddp"), ("fsdp", "parallel=fsdp"), ("fsdp_full", "parallel=fsdp")],
)
def test_checkpoint_of_the_old_classes_resumes(tmp_path, written, strategy):
    """Step 3 of 6, resumed: steps 4 to 6 have single's losses and end at single's weights."""
    saved = shutil.copytree(FIXTURES / written, tmp_path / "step-000003")
    run_dir = tmp_path / "run"
    run = (*TINY_SGD, "trainer.checkpoint_every=3", strategy, "parallel.devices=2")
    result = run_train(*run, f"trainer.resume={saved}", run_dir=run_dir)
    assert f"resuming from {saved} at step 3" in result.stdout
    reference = reference_run(*TINY_SGD)
    # The resumed run logged steps 4 to 6 only; compare them with single's.
    expected = train_losses(reference)[3:]
    assert train_losses(run_dir) == pytest.approx(expected, abs=1e-5)
    expected_weights, weights = checkpoint(reference)["model"], checkpoint(run_dir)["model"]
    assert list(weights) == list(expected_weights), "not single's keys in single's order"
    for key, weight in expected_weights.items():
        assert (weights[key] - weight).abs().max().item() < 1e-5, key
