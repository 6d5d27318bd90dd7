"""Runs that are killed, stopped or crash mid-checkpoint lose nothing: resumed, they end exactly
where an uninterrupted run ends.

The interrupted runs are real `train.py` processes, signalled once their output shows a step.
Their stdout is a pipe of one page that the test stops reading at that point, so a run can get
at most a page of log lines (a few dozen steps) ahead and cannot finish first: no sleeps, no
races, whatever the machine's load.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    ROOT,
    TINY_SGD,
    TrainRun,
    assert_goes_on_exactly,
    assert_same_training,
    checkpoint,
    kill_and_resume,
    metrics,
    rank_pids,
    reference_run,
    run_train,
    tokens_run,
    write_tokens,
)

from src.checkpoint.store import resume_path, saved_checkpoints
from src.checkpoint.writer import CheckpointWriter
from src.config.parallel import ParallelConfig
from src.parallel.base import Strategy

# 60 steps, each logged (TINY), a checkpoint every 5: step 6's log line means step 5 is saved.
RESUMABLE = (*TINY_SGD, "trainer.max_steps=60", "trainer.checkpoint_every=5")
DDP = ("parallel=ddp", "parallel.devices=2")
FSDP = ("parallel=fsdp", "parallel.devices=2")
HYBRID = ("parallel=hybrid", "parallel.devices=4", "parallel.stages=2", "parallel.microbatches=2")


@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy",
    [("parallel=dp",), ("parallel=model_parallel", "parallel.microbatches=2")],
    ids=["dp", "model_parallel"],
)
def test_killed_run_resumes_to_the_same_weights(tmp_path, strategy):
    """Killed mid-run and resumed, a strategy ends where an uninterrupted `single` run does.
    (`single` itself: `test_run_reading_with_workers_resumes_at_the_samplers_position`. The
    multi-process strategies resume the same way in `test_multi_process_job_stops_as_one_and_
    resumes`, from the checkpoint their stop wrote rather than a periodic one.)"""
    kill_and_resume(tmp_path, *RESUMABLE, *strategy, reference=reference_run(*RESUMABLE))


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_killed_gpu_run_resumes_to_the_same_weights(tmp_path):
    gpu = (*RESUMABLE, "trainer.accelerator=cuda", "trainer.matmul_precision=highest")
    kill_and_resume(tmp_path, *gpu, reference=reference_run(*gpu))


@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_run_reading_with_workers_resumes_at_the_samplers_position(tmp_path):
    """A token file read by 2 DataLoader workers, under `single`: started with
    trainer.resume=auto and no checkpoint yet (afresh), killed (SIGKILL) and resumed from its
    periodic checkpoint, then stopped with Ctrl-C (which signals the workers too: it stops
    gracefully after the step) and resumed again, the run starts its sampler at each checkpoint's
    step (batches are a function of (seed, step); none replayed) and ends where an uninterrupted
    run reading in-process ends."""
    token_file = tmp_path / "train.bin"
    write_tokens(token_file)
    resumable = (*tokens_run(token_file), "trainer.max_steps=60", "trainer.checkpoint_every=5")
    reference = reference_run(*resumable, "data.num_workers=0")
    run_dir = tmp_path / "run"
    with_workers = (*resumable, "data.num_workers=2", "trainer.resume=auto")
    run = TrainRun(*with_workers, run_dir=run_dir, one_page=True)
    run.wait_for("step 6/60")
    run.process.kill()
    killed = run.finish()
    assert killed.returncode == -signal.SIGKILL
    assert f"trainer.resume=auto: no checkpoint in {run_dir} yet, starting afresh" in killed.stdout
    assert not (run_dir / "summary.json").exists()
    saved_step = checkpoint(run_dir)["step"]
    assert 5 <= saved_step < 60

    run = TrainRun(*with_workers, run_dir=run_dir, one_page=True)
    run.wait_for("step 12/60")
    resumed_from = run_dir / "checkpoints" / f"step-{saved_step:06d}"
    assert any(f"resuming from {resumed_from} at step {saved_step}" in line for line in run.lines)
    os.killpg(run.process.pid, signal.SIGINT)
    finished = run.finish()
    assert finished.returncode == 128 + signal.SIGINT, finished.stdout[-3000:]
    assert "SIGINT received: stopping after the current step" in finished.stdout
    assert "Traceback" not in finished.stdout and "KeyboardInterrupt" not in finished.stdout
    assert "trainer.resume=auto" in finished.stdout.split("resume with:")[1]
    assert 12 <= stopped_step(finished.stdout, "SIGINT", run_dir) < 60

    run_train(*with_workers, run_dir=run_dir)
    assert_same_training(reference, run_dir)
    assert checkpoint(run_dir)["step"] == 60


@pytest.mark.timeout(300)
def test_sigterm_stops_after_the_step_and_prints_the_resume_command(tmp_path):
    """W&B (offline) included: the resumed run continues the same W&B run."""
    overrides = [o for o in RESUMABLE if o != "logger=none"] + ["logger=wandb"]
    run = TrainRun(*overrides, run_dir=tmp_path, one_page=True)
    run.wait_for("step 6/60")
    run.process.send_signal(signal.SIGTERM)
    finished = run.finish()
    returncode, output = finished.returncode, finished.stdout

    assert returncode == 128 + signal.SIGTERM
    state = checkpoint(tmp_path)
    assert state["step"] == stopped_step(output, "SIGTERM", tmp_path) < 60
    assert not (tmp_path / "summary.json").exists()
    resume_with_the_printed_command(output, tmp_path)
    assert_same_training(reference_run(*RESUMABLE), tmp_path)
    run_id = state["tracker_run_ids"]["wandb"]
    assert run_id and checkpoint(tmp_path)["tracker_run_ids"]["wandb"] == run_id
    wandb_runs = sorted(path.name for path in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(name.endswith(f"-{run_id}") for name in wandb_runs)


def stopped_step(output: str, signal_name: str, run_dir: Path) -> int:
    """The step the run says it stopped after, having saved its checkpoint."""
    stopped = re.search(
        rf"stopped by {signal_name} after step (\d+); checkpoint saved to (\S+); ", output
    )
    assert stopped, output
    assert stopped[2] == str(run_dir / "checkpoints" / f"step-{int(stopped[1]):06d}")
    return int(stopped[1])


def resume_with_the_printed_command(output: str, run_dir: Path) -> None:
    command = output.split("resume with:\n")[1].splitlines()[0].strip()
    python, script, *overrides, run_dir_override = shlex.split(command)
    assert (python, script) == ("python", "train.py")
    assert overrides[-1] == "trainer.resume=auto" and run_dir_override == f"hydra.run.dir={run_dir}"
    run_train(*overrides, run_dir=run_dir)


@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy, signum, target",
    [
        (DDP, signal.SIGINT, "process group"),  # Ctrl-C: the terminal signals every process
        (DDP, signal.SIGTERM, "one rank"),  # the other rank never hears of it but for its peer
        # `kill <pid>` of train.py, as a scheduler would; the checkpoint gathers the ranks' shards.
        (FSDP, signal.SIGTERM, "launcher"),
        # Two pipelines of two stages each; a scheduler's cancel signals every process of the job.
        (HYBRID, signal.SIGTERM, "process group"),
    ],
    ids=[
        "ddp-ctrl-c",
        "ddp-sigterm-one-rank",
        "fsdp-sigterm-launcher",
        "hybrid-sigterm-process-group",
    ],
)
def test_multi_process_job_stops_as_one_and_resumes(tmp_path, strategy, signum, target):
    """Every rank stops after the same step, the checkpoint is written once, the job exits like
    a single run and resumes to the weights of an uninterrupted run."""
    reference = reference_run(*RESUMABLE)
    run = TrainRun(*RESUMABLE, *strategy, run_dir=tmp_path, one_page=True)
    run.wait_for("step 6/60")
    if target == "launcher":
        run.process.send_signal(signum)
    elif target == "process group":
        os.killpg(run.process.pid, signum)
    else:
        os.kill(rank_pids(run.process.pid)[-1], signum)
    finished = run.finish()
    returncode, output = finished.returncode, finished.stdout

    assert returncode == 128 + signum
    name = signal.Signals(signum).name
    assert 6 <= stopped_step(output, name, tmp_path) == checkpoint(tmp_path)["step"] < 60
    assert "Traceback" not in output and "failed" not in output, output
    assert not (tmp_path / "summary.json").exists()
    resume_with_the_printed_command(output, tmp_path)
    assert_same_training(reference, tmp_path)


@pytest.mark.timeout(300)
def test_a_signal_while_ddp_ranks_start_up_stops_them_together(tmp_path):
    """Signalled before their process group, data and model exist (most likely: they get there
    in about a second), the ranks neither die nor hang: they stop after the same step."""
    run = TrainRun(*RESUMABLE, *DDP, run_dir=tmp_path, one_page=True)
    run.wait_for("intra-op thread", times=2)
    run.process.send_signal(signal.SIGTERM)
    finished = run.finish()
    returncode, output = finished.returncode, finished.stdout

    assert returncode == 128 + signal.SIGTERM, output
    assert 1 <= stopped_step(output, "SIGTERM", tmp_path) == checkpoint(tmp_path)["step"] < 60


@pytest.mark.timeout(300)
def test_a_second_signal_stops_a_ddp_job_at_once(tmp_path):
    """The ranks would only stop at their next log, eval or checkpoint, which never comes: the
    first signal cannot end the job, the second one does, at once."""
    never_in_sync = (
        "trainer.log_every=100000",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
    )
    run = TrainRun(
        *RESUMABLE,
        *never_in_sync,
        "trainer.max_steps=100000",
        *DDP,
        run_dir=tmp_path,
        one_page=True,
    )
    run.wait_for("intra-op thread", times=2)  # both ranks are up, and hold their stop signals
    run.process.send_signal(signal.SIGTERM)
    run.wait_for("SIGTERM received: the ranks stop together")
    run.process.send_signal(signal.SIGINT)
    finished = run.finish()
    returncode, output = finished.returncode, finished.stdout

    assert returncode == 128 + signal.SIGINT, output
    assert "stopped by SIGINT at once; no checkpoint was written; resume with:" in output
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("schedule_steps", [6, 12], ids=["keep", "stretch"])
def test_more_steps_on_resume_keep_or_stretch_the_schedule_as_asked(tmp_path, schedule_steps):
    """6 steps trained with a cosine from 0.05 down to 0.005, then 6 more: kept, the new steps
    stay at 0.005; stretched over 12 steps, the rate goes back up, and the log says so."""
    trained = TINY_SGD
    finished = saved_checkpoints(reference_run(*trained))[-1]
    result = run_train(
        *trained,
        "trainer.max_steps=12",
        f"optimizer.schedule_steps={schedule_steps}",
        f"trainer.resume={finished}",
        run_dir=tmp_path,
    )

    def cosine(step: int) -> float:
        return 0.005 + 0.045 * 0.5 * (1 + math.cos(math.pi * min(1, step / schedule_steps)))

    rates = [row["train/lr"] for row in metrics(tmp_path) if "train/lr" in row]
    assert rates == pytest.approx([cosine(step) for step in range(6, 12)])
    assert f"resuming from {finished} at step 6, learning rate {cosine(6):.3g}" in result.stdout
    changed = "the learning-rate schedule differs from the checkpoint's: step 7 runs at 0.0275 "
    assert (changed + "instead of 0.005" in result.stdout) == (schedule_steps == 12)


# torch's Adagrad by its target (sgd's momentum left out), warm-up then wsd: 1 - sqrt over the
# last half of the 6 steps (steps 4, 5 and 6), checkpointed after step 4.
ADAGRAD_WSD = (
    *DDP,
    *TINY_SGD,
    "optimizer._target_=torch.optim.Adagrad",
    "optimizer.warmup_steps=2",
    "optimizer.schedule=wsd",
    "optimizer.decay_fraction=0.5",
    "optimizer.decay_shape=1-sqrt",
    "trainer.checkpoint_every=4",
    "trainer.eval_every=0",
    "trainer.test=false",
)


@pytest.mark.equivalence
def test_an_optimizer_by_target_resumes_mid_decay_exactly_under_ddp(tmp_path):
    """Resumed from step 4 under ddp x 2, in the middle of wsd's decay, the run logs the
    uninterrupted run's losses and rates and ends at its weights: Adagrad's sums and the
    schedule's step come back from the checkpoint."""
    run_train(*ADAGRAD_WSD, run_dir=tmp_path / "whole")
    middle = tmp_path / "whole" / "checkpoints" / "step-000004"
    run_train(*ADAGRAD_WSD, f"trainer.resume={middle}", run_dir=tmp_path / "resumed")
    assert_goes_on_exactly(tmp_path / "whole", tmp_path / "resumed", [5, 6])
    rates = [
        {row["step"]: row["train/lr"] for row in metrics(run_dir) if "train/lr" in row}
        for run_dir in (tmp_path / "whole", tmp_path / "resumed")
    ]
    assert rates[1] == {step: rates[0][step] for step in (5, 6)}
    assert rates[0][4] > rates[0][5] > rates[0][6] > 0.005  # decaying, not yet at its floor
    state = checkpoint(tmp_path / "resumed")["optimizer"]["state"]
    assert all(set(param) == {"step", "sum"} for param in state.values())  # Adagrad's


WRITE_HALF_THEN_HANG = """
import io, sys, torch
from pathlib import Path
from src.checkpoint.writer import CheckpointWriter
from src.parallel.base import Strategy

real_save = torch.save

def write_half_then_hang(state, file):
    buffer = io.BytesIO()
    real_save(state, buffer)
    file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    file.flush()
    print("half written", flush=True)
    sys.stdin.read()  # until the test kills this process

torch.save = write_half_then_hang
save(CheckpointWriter(Path(sys.argv[1]), Strategy(ParallelConfig(), "cpu"), "full", 2, False), 2)
"""

SAVE = """
from src.config.parallel import ParallelConfig

def save(writer, step):
    model = torch.nn.Linear(10, 10)
    torch.nn.init.constant_(model.weight, step)
    optimizer = torch.optim.SGD(model.parameters())
    writer.save(model, optimizer, {"step": step, "rng": {}, "config": {}, "tracker_run_ids": {}})
"""


def test_checkpoint_write_killed_midway_leaves_the_previous_one(tmp_path):
    """The new checkpoint is written in a staging folder, renamed once complete: killed before,
    it is absent, the previous one intact; the next save clears the leftovers."""
    namespace: dict = {"torch": torch}
    exec(SAVE, namespace)
    writer = CheckpointWriter(tmp_path, Strategy(ParallelConfig(), "cpu"), "full", 2, False)
    namespace["save"](writer, 1)
    killed = subprocess.Popen(
        [sys.executable, "-c", SAVE + WRITE_HALF_THEN_HANG, str(tmp_path)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert killed.stdout.readline() == "half written\n"
    (staging,) = (tmp_path / "checkpoints").glob(".staging-*")  # the new one, half written
    assert (staging / "checkpoint.pt").stat().st_size > 0
    killed.kill()
    killed.wait()

    assert [p.name for p in saved_checkpoints(tmp_path)] == ["step-000001"]
    assert resume_path("auto", tmp_path) == tmp_path / "checkpoints" / "step-000001"
    assert checkpoint(tmp_path)["step"] == 1
    namespace["save"](writer, 3)  # the next write still works
    assert checkpoint(tmp_path)["step"] == 3
    assert torch.equal(checkpoint(tmp_path)["model"]["weight"], torch.full((10, 10), 3.0))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000001",
        "step-000003",
    ]
