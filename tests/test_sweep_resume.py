"""A sweep killed mid-job, run again with the same command and `hydra.sweep.dir`
(src/launch/sweep.py)."""

from __future__ import annotations

import json
import os
import signal

from helpers import TINY_SGD, TrainRun, assert_same_training, metrics, run_sweep

# Job 0 (FaultyMLP, the MLP's arithmetic) fails in its second step while FAIL_AT_STEP=2, job 1
# checkpoints every 5 steps: the test kills the sweep in job 1's step 8.
SWEEP = (
    *[o for o in TINY_SGD if not o.startswith("trainer.max_steps=")],
    "trainer.max_steps=40",
    "trainer.checkpoint_every=5",
    "model._target_=tests.faulty_models.FaultyMLP,src.components.models.MLP",
)
FAIL_IN_STEP_2 = {"FAULT": "raise", "FAIL_AT_STEP": "2", "FAIL_RANK": "0"}
NO_FAULT = {**FAIL_IN_STEP_2, "FAIL_AT_STEP": "1000"}


def statuses(sweep_dir) -> list[str]:
    return [json.loads((sweep_dir / job / "status.json").read_text())["status"] for job in "01"]


def test_a_killed_sweep_run_again_resumes_what_did_not_finish(tmp_path):
    sweep_dir = tmp_path / "sweep"
    run = TrainRun(*SWEEP, sweep_dir=sweep_dir, env=FAIL_IN_STEP_2, one_page=True)
    run.wait_for("step 8/40")  # job 1; it cannot get a page of output further
    os.killpg(run.process.pid, signal.SIGKILL)
    run.finish()
    failed, killed = sweep_dir / "0", sweep_dir / "1"
    assert json.loads((failed / "status.json").read_text())["status"] == "failed"
    assert not (killed / "status.json").exists() and (killed / "checkpoints").is_dir()

    # The same command: job 0 runs again (it passes now), job 1 continues from its checkpoint.
    result = run_sweep(*SWEEP, sweep_dir=sweep_dir, env=NO_FAULT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert statuses(sweep_dir) == ["ok", "ok"]
    log = (killed / "train.log").read_text()
    assert "step-000005 at step 5, learning rate" in log, log[-3000:]
    steps = [row["step"] for row in metrics(killed) if "train/loss" in row]
    assert steps == list(range(1, 41))  # no gap, no step twice
    assert_same_training(failed, killed)  # the restarted job trained what the resumed one did
    assert "| ok |" in (sweep_dir / "summary.md").read_text()

    # Again: nothing is left to do, and the report is rebuilt from both jobs.
    summaries = [(sweep_dir / job / "summary.json").read_bytes() for job in "01"]
    result = run_sweep(*SWEEP, sweep_dir=sweep_dir, env=NO_FAULT)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("finished in an earlier run of this sweep: kept") == 2
    assert [(sweep_dir / job / "summary.json").read_bytes() for job in "01"] == summaries
    assert (sweep_dir / "summary.md").read_text().count("| ok |") == 2


def test_a_sweep_dir_is_resumed_only_by_its_own_command(tmp_path):
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    (sweep_dir / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task: ['optimizer.lr=0.1,0.2']\n"
        "  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "    max_batch_size: null\n    params: null\n"
    )
    result = run_sweep("optimizer.lr=0.1,0.3", "logger=none", sweep_dir=sweep_dir)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "holds the jobs of another command (optimizer.lr=0.1,0.2" in line
    assert not (sweep_dir / "0").exists()
