"""The README's front page: every `python train.py`, `python eval.py` and `python plan.py` command
in its shell blocks runs and exits 0.

The install and test commands of the same blocks (`pip install ...`, `ruff check .`,
`python -m pytest`) are not run here: CI (`.ci/run`) runs exactly them, and a test suite that
installs packages or runs itself would need the network and run every test twice."""

from __future__ import annotations

import re
import shlex

import pytest
from helpers import ROOT, run_eval, run_plan, run_sweep, run_train

FENCED_SHELL = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.MULTILINE | re.DOTALL)
ENTRY_POINTS = ("train.py", "eval.py", "plan.py")
CHEAP = ("trainer.max_steps=2",)


def front_page_commands() -> list[list[str]]:
    """The `python train.py|eval.py|plan.py ...` commands of README.md's shell blocks, as
    argument lists: continued lines joined, comments dropped, each line and each command of
    `a && b` on its own."""
    commands = []
    for block in FENCED_SHELL.findall((ROOT / "README.md").read_text()):
        lines = block.replace("\\\n", " ").splitlines()
        words = [word for line in lines for word in [*shlex.split(line, comments=True), ";"]]
        command: list[str] = []
        for word in [*words, "&&"]:
            if word not in ("&&", ";"):
                command.append(word)
                continue
            if command[:1] == ["python"] and command[1:2] and command[1] in ENTRY_POINTS:
                commands.append(command)
            command = []
    return commands


COMMANDS = front_page_commands()


def test_the_front_page_has_the_default_run_a_sweep_and_a_plan():
    """The parsing above finds what the front page promises (else the test below tests nothing)."""
    assert ["python", "train.py"] in COMMANDS, COMMANDS
    assert any("-m" in command for command in COMMANDS), COMMANDS
    assert any(command[1] == "plan.py" for command in COMMANDS), COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c[1:]) for c in COMMANDS])
def test_a_front_page_command_runs(command, tmp_path):
    """Each command as written, on the CPU (`helpers.on_cpu`: the tests expect CPU processes),
    with its run or sweep folder in tmp_path, and these additions to keep it cheap: the plain
    default run (the first command) trains `trainer.max_steps=2`, since tests/test_single.py
    trains and checks its full 300 steps; a sweep trains `trainer.max_steps=2` with
    `logger=none`, since what is checked here is that every job runs and the table and plot are
    written, and tests/test_sweeps.py checks the report's figures and its W&B run; an eval
    command evaluates a cheap default run, named as `run_dir` (the newest run in outputs/
    otherwise)."""
    entry_point, *overrides = command[1:]
    if entry_point == "plan.py":
        result = run_plan(*overrides)
        assert result.returncode == 0, result.stderr[-4000:]
        assert "recommended: parallel=" in result.stdout
    elif entry_point == "eval.py":
        run_train(*CHEAP, "logger=none", run_dir=tmp_path / "run")
        run_eval(*overrides, f"run_dir={tmp_path / 'run'}", eval_dir=tmp_path / "eval")
        assert (tmp_path / "eval" / "eval.json").is_file()
    elif "-m" in overrides:
        sweep = [override for override in overrides if override != "-m"]
        result = run_sweep(*sweep, *CHEAP, "logger=none", sweep_dir=tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        assert (tmp_path / "summary.md").is_file() and (tmp_path / "scaling.png").is_file()
    else:
        run_train(*overrides, *([] if overrides else CHEAP), run_dir=tmp_path, check=True)
        assert (tmp_path / "summary.json").is_file()


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as '-'."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)  # no `# ...`
    headings = re.findall(r"^#+ (.*)$", prose, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.smoke
def test_every_link_of_the_readme_and_docs_reaches_a_file_and_heading():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and anchor not in anchors(linked.read_text())):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
