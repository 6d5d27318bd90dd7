"""A finished `train.py` or `plan.py` ends without the interpreter's teardown of its modules
(`src/runtime/torch_private.py`), and with everything else an exit does: its status, its exit
handlers, its threads, its logs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT

# A program whose module teardown would say so: `Trace.__del__` runs only when Python frees the
# module's globals on its way out.
PROGRAM = """
import atexit, logging, sys, threading, time
from src.runtime.torch_private import exit_without_teardown

class Trace:
    def __del__(self):
        print("torn down", flush=True)

trace = Trace()
logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
with exit_without_teardown():
    atexit.register(lambda: print("exit handler ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
    logging.getLogger("test").info("logged before the exit")
    {ending}
"""


def run_program(ending: str, log_file: str) -> subprocess.CompletedProcess:
    source = textwrap.dedent(PROGRAM).format(ending=ending)
    return subprocess.run(
        [sys.executable, "-c", source, "-", log_file],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(("ending", "status"), [("pass", 0), ("sys.exit(3)", 3)])
def test_a_finished_process_skips_the_teardown_and_keeps_all_else(ending, status, tmp_path):
    log_file = tmp_path / "run.log"
    ended = run_program(ending, str(log_file))
    assert ended.returncode == status, ended.stderr
    assert ended.stdout.splitlines() == ["thread finished", "exit handler ran"]
    assert "logged before the exit" in log_file.read_text()
    assert ended.stderr == ""


def test_an_uncaught_error_keeps_pythons_report_and_teardown(tmp_path):
    ended = run_program("raise RuntimeError('boom')", str(tmp_path / "run.log"))
    assert ended.returncode == 1
    assert "RuntimeError: boom" in ended.stderr
    assert ended.stdout.splitlines()[-1] == "torn down"
