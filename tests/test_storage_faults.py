"""Storage faults lose nothing: a checkpoint written to a full disk fails cleanly (or, with
trainer.checkpoint_errors=warn, training goes on), and a checkpoint whose files are not the ones
written (cut short, a bit flipped) is passed over by resume and refused where it is named.

The full disk is a tmpfs mounted as the run's checkpoints/ folder, sized for one and a half of
the run's checkpoints: step 3's fits, step 6's does not."""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TINY_SGD, assert_same_training, run_eval, run_train, summary

from src.checkpoint.store import check_intact, resume_path, saved_checkpoints

# SGD, a checkpoint at steps 3 and 6, no best checkpoint (its writes would share the disk).
RUN = (*TINY_SGD, "trainer.checkpoint_every=3", "trainer.monitor=null")
FORMATS = {"full": ("parallel=single",), "sharded": ("parallel=fsdp", "parallel.devices=2")}
PAGE = 4096  # tmpfs counts whole pages
NINE_STEPS = ("trainer.max_steps=9",)


@functools.cache
def written(fmt: str) -> Path:
    """A finished run of RUN in `fmt` (copy it before changing it), once per session."""
    run_dir = Path(tempfile.mkdtemp(prefix="storage-faults-"))
    run_train(*RUN, *FORMATS[fmt], run_dir=run_dir)
    return run_dir


def pages_of(folder: Path) -> int:
    return sum(math.ceil(path.stat().st_size / PAGE) for path in folder.iterdir())


@contextlib.contextmanager
def small_disk(folder: Path, pages: int) -> Iterator[Path]:
    """A tmpfs of `pages` pages mounted at `folder` (skips where mounting is not permitted)."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={pages * PAGE}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def run_on_a_small_disk(tmp_path: Path, fmt: str, *overrides: str) -> subprocess.CompletedProcess:
    """RUN in `fmt` with room on disk for step 3's checkpoint and half another; afterwards only
    step 3's is there, complete, and it is what resume would take."""
    run_dir = tmp_path / "run"
    room = pages_of(written(fmt) / "checkpoints" / "step-000003") * 3 // 2
    with small_disk(run_dir / "checkpoints", room):
        result = run_train(*RUN, *FORMATS[fmt], *overrides, run_dir=run_dir, check=False)
        step_3 = run_dir / "checkpoints" / "step-000003"
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [step_3.name]
        check_intact(step_3)
        assert resume_path("auto", run_dir) == step_3
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_full_disk_ends_the_run_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, fmt):
    result = run_on_a_small_disk(tmp_path, fmt)

    assert result.returncode == 1
    folder = tmp_path / "run" / "checkpoints"
    line = (
        f"checkpoint step-000006 not written: the disk is full (No space left on device) in "
        f"{folder}: it needs at least "
    )
    errors = [text for text in result.stdout.splitlines() if "[ERROR]" in text]
    assert len(errors) == 1 and line in errors[0], result.stdout[-3000:]
    assert "step-000003 is kept" in errors[0] and "Traceback" not in result.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "fmt, overrides",
    [("full", ()), ("sharded", ("trainer.async_checkpoint=true",))],
    ids=["full", "sharded-async"],
)
def test_with_checkpoint_errors_warn_a_full_disk_is_a_warning_and_training_goes_on(
    tmp_path, fmt, overrides
):
    """Steps 6 and 9 fail, each with a warning, and the run ends; asynchronously, step 6's
    failure in the background surfaces at step 9's save."""
    result = run_on_a_small_disk(
        tmp_path, fmt, *overrides, *NINE_STEPS, "trainer.checkpoint_errors=warn"
    )

    assert result.returncode == 0, result.stdout[-3000:]
    warnings = [text for text in result.stdout.splitlines() if "not written" in text]
    assert [("step-000006" in text, "step-000009" in text) for text in warnings] == [
        (True, False),
        (False, True),
    ]
    assert all("the disk is full" in text and "training goes on" in text for text in warnings)
    assert summary(tmp_path / "run")["steps"] == 9


def damaged_copy(fmt: str, tmp_path: Path, damage: str) -> tuple[Path, str]:
    """A copy of `written(fmt)` whose step 6 checkpoint is damaged (`truncated` or
    `bit-flipped`) and whose step 3 has no manifest (as checkpoints written before manifests);
    with what the check must say of step 6."""
    run_dir = tmp_path / "run"
    shutil.copytree(written(fmt), run_dir)
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoints" / "step-000003" / "manifest.json").unlink()
    step_6 = run_dir / "checkpoints" / "step-000006"
    name = "checkpoint.pt" if fmt == "full" else "__1_0.distcp"
    data = bytearray((step_6 / name).read_bytes())
    if damage == "truncated":
        (step_6 / name).write_bytes(data[: len(data) // 2])
        return run_dir, f"{step_6} is corrupt: {name} is {len(data) // 2} bytes, {len(data)} when"
    data[len(data) // 2] ^= 1
    (step_6 / name).write_bytes(data)
    return run_dir, f"{step_6} is corrupt: {name} has crc32 "


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("damage", ["truncated", "bit-flipped"])
def test_resume_passes_over_a_corrupt_newest_checkpoint_with_a_warning(tmp_path, fmt, damage):
    run_dir, said = damaged_copy(fmt, tmp_path, damage)

    result = run_train(*RUN, "parallel=single", "trainer.resume=auto", run_dir=run_dir)

    warnings = [text for text in result.stdout.splitlines() if "[WARNING]" in text]
    assert len(warnings) == 1 and said in warnings[0], result.stdout[-3000:]
    assert "resuming from the checkpoint before it" in warnings[0]
    assert f"resuming from {run_dir}/checkpoints/step-000003 at step 3" in result.stdout
    assert_same_training(written(fmt), run_dir)
    check_intact(saved_checkpoints(run_dir)[-1])  # step 6 written again, with its manifest


@pytest.mark.parametrize("setting", ["trainer.resume", "trainer.init_from", "ckpt_path"])
def test_a_corrupt_checkpoint_named_explicitly_is_one_line_and_exit_2(tmp_path, setting):
    run_dir, said = damaged_copy("full", tmp_path, "bit-flipped")
    step_6 = run_dir / "checkpoints" / "step-000006"
    if setting == "ckpt_path":
        result = run_eval(f"ckpt_path={step_6}", eval_dir=tmp_path / "eval", check=False)
    else:
        result = run_train(*RUN, f"{setting}={step_6}", run_dir=tmp_path / "new", check=False)

    output = result.stdout + result.stderr  # eval.py refuses it before its log starts
    assert result.returncode == 2 and "Traceback" not in output
    lines = [text for text in output.splitlines() if said in text]
    assert len(lines) == 1 and f"{setting}: {said}" in lines[0], output[-3000:]
