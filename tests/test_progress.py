"""Long phases show progress in one bar style (`src/runtime/progress.py`): evaluation batches,
checkpoint writes and data preparation print lines with an ETA once they have run
trainer.progress_every_s (here 0, standing in for a slow phase, or 100, for a fast one); on a
terminal the line is redrawn in place; a fast phase prints nothing extra."""

from __future__ import annotations

import contextlib
import io
import logging
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from src.checkpoint.durable import save_file
from src.components.data import logged_progress, synthetic_classification
from src.components.tasks import Classification
from src.components.text import text
from src.config.parallel import ParallelConfig
from src.parallel import build_strategy
from src.runtime import progress
from src.training.build import load_showing_progress
from src.training.step import evaluate

BAR = r"\[[#.]{20}\] "
ETA = r" \| eta \d+s"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def evaluation(tmp_path) -> tuple[str, str]:
    data = synthetic_classification(0, 4, 3, 200, 0.25, 0.1)  # 50 val samples: 5 batches of 10
    single = build_strategy(ParallelConfig(), "cpu")
    single.setup()
    model = torch.nn.Linear(4, 3)
    evaluate(model, single, Classification(), data.val, 10, contextlib.nullcontext())
    return "val", r"val batch [1-5]/5"


def checkpoint_write(tmp_path) -> tuple[str, str]:
    save_file({"model": {"w": torch.zeros(256, 256)}}, tmp_path / "c.pt", "checkpoint step-1")
    return "writing checkpoint step-1", r"writing checkpoint step-1 \d[\d.]* (bytes|kB)/262 kB"


def checkpoint_read(tmp_path) -> tuple[str, str]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    load_showing_progress(model, model.state_dict())
    what = "reading the checkpoint's weights"
    return what, rf"{what} \d[\d.]* (bytes|kB)/33.3 kB"


def sharded_write(tmp_path) -> tuple[str, str]:
    from src.checkpoint.sharded_progress import SavePlannerShowingProgress

    showing = SavePlannerShowingProgress("writing checkpoint s")
    dcp.save({"w": torch.zeros(256, 256)}, checkpoint_id=tmp_path / "s", planner=showing)
    showing.finish()
    return "writing checkpoint s", r"writing checkpoint s 262 kB/262 kB"


def sharded_read(tmp_path) -> tuple[str, str]:
    from src.checkpoint.sharded_progress import LoadPlannerShowingProgress

    dcp.save({"w": torch.ones(256, 256)}, checkpoint_id=tmp_path / "s")
    state, showing = {"w": torch.zeros(256, 256)}, LoadPlannerShowingProgress("reading s")
    dcp.load(state, checkpoint_id=tmp_path / "s", planner=showing)
    showing.finish()
    assert state["w"].eq(1).all()
    return "reading s", r"reading s 262 kB/262 kB"


def tokenizing(tmp_path) -> tuple[str, str]:
    file = tmp_path / "a.txt"
    file.write_text("\n\n".join(f"document {i}" for i in range(40)))
    text(0, str(file), "char", "text", "paragraph", 2, None, 0.1, 0.1, None, 1)
    size = file.stat().st_size  # each document's characters counted as read
    return "tokenizing", rf"tokenizing \d+ bytes/{size} bytes"


def data_building(tmp_path) -> tuple[str, str]:
    assert list(logged_progress(range(3), "building")) == [0, 1, 2]
    return "building", r"building [1-3]/3"


@pytest.mark.parametrize(
    "phase",
    [
        evaluation,
        checkpoint_write,
        checkpoint_read,
        sharded_write,
        sharded_read,
        tokenizing,
        data_building,
    ],
)
@pytest.mark.parametrize("mode", ["log", "terminal", "fast"])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_long_phases_show_progress_with_an_eta(phase, mode, monkeypatch, caplog, tmp_path):
    terminal = Terminal()
    settings = progress.ProgressSettings(
        every_s=100.0 if mode == "fast" else 0.0,
        stream=terminal if mode == "terminal" else io.StringIO(),
    )
    monkeypatch.setattr(progress, "SETTINGS", settings)
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        what, shown = phase(tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == progress.__name__]
    if mode == "fast":
        assert lines == [] and terminal.getvalue() == ""
        return
    assert re.fullmatch(rf"{what}: done in \d+\.\d s", lines[-1])
    bars = lines[:-1] if mode == "log" else terminal.getvalue().split(progress.CLEAR_LINE)[1:-1]
    assert bars and all(re.fullmatch(BAR + shown + ETA, bar) for bar in bars), bars
    if mode == "terminal":  # redrawn in place: no line of its own in the log, the last erased
        assert len(lines) == 1 and terminal.getvalue().endswith(progress.CLEAR_LINE)


def test_only_rank_0_shows_progress(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(progress, "SETTINGS", progress.ProgressSettings(every_s=0.0, shown=False))
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        data_building(tmp_path)
    assert caplog.records == []
