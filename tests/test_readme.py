"""The README's front page: every `python train.py`, `python eval.py` and `python plan.py` command
in its shell blocks runs and exits 0; its recipe from a folder of text to transformers runs as
written, command after command, on a small text the test writes.

The install and test commands of the same blocks (`pip install ...`, `ruff check .`,
`python -m pytest`) are not run here: CI (`.ci/run`) runs exactly them, and a test suite that
installs packages or runs itself would need the network and run every test twice."""

from __future__ import annotations

import os
import random
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers import (
    QUIET_AND_FRUGAL,
    ROOT,
    run_eval,
    run_plan,
    run_sweep,
    run_train,
    write_trained_tiktoken,
)

FENCED_SHELL = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.MULTILINE | re.DOTALL)
FENCED_PYTHON = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
ENTRY_POINTS = ("train.py", "eval.py", "plan.py")
CHEAP = ("trainer.max_steps=2",)
RECIPE = "## From a folder of text to transformers"


def readme_sections() -> tuple[str, str]:
    """README.md without its text recipe's section, and that section."""
    readme = (ROOT / "README.md").read_text()
    before, _, rest = readme.partition(RECIPE)
    recipe, heading, after = rest.partition("\n## ")
    return before + heading + after, recipe


def shell_commands(markdown: str) -> list[list[str]]:
    """The `python ...` commands of the markdown's shell blocks, as argument lists: continued
    lines joined, comments dropped, each line and each command of `a && b` on its own."""
    commands = []
    for block in FENCED_SHELL.findall(markdown):
        lines = block.replace("\\\n", " ").splitlines()
        words = [word for line in lines for word in [*shlex.split(line, comments=True), ";"]]
        command: list[str] = []
        for word in [*words, "&&"]:
            if word not in ("&&", ";"):
                command.append(word)
                continue
            if command[:1] == ["python"]:
                commands.append(command)
            command = []
    return commands


def front_page_commands() -> list[list[str]]:
    """The `python train.py|eval.py|plan.py ...` commands of README.md's shell blocks, the text
    recipe's left to its own test."""
    commands = shell_commands(readme_sections()[0])
    return [command for command in commands if command[1:2] and command[1] in ENTRY_POINTS]


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


# The text of the recipe's folder: a few files of lines drawn from these.
LINES = [
    "To be, or not to be, that is the question.",
    "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune,",
    "or to take arms against a sea of troubles, and by opposing end them.",
    "To die, to sleep; no more; and by a sleep to say we end the heart-ache.",
]
# What the test adds to the recipe's training: a BPE of GPT-2's kind trained on the text, as a
# `.tiktoken` file (the README's default, GPT-2's own, needs the network once), a tiny GPT and a
# few steps, on the CPU.
TINY_TEXT_GPT = (
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=16",
    "data.seq_len=64",  # positions for the Python block's prompt and 50 new tokens
    "trainer.batch_size=8",
    "trainer.max_steps=4",
    "trainer.eval_every=0",
    "logger=none",
)


def run_as_written(command: list[str], folder: Path, *additions: str) -> None:
    """`python <script> ...` in `folder`, the repository's script, with `additions` after the
    command's own arguments."""
    _, script, *arguments = command
    environment = {**os.environ, **QUIET_AND_FRUGAL, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / script), *arguments, *additions],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{shlex.join(command)}:\n{result.stderr[-4000:]}"


def run_module_here(command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m <module> ...` in this process (which has imported torch already), in the
    current folder (runpy warns that the module the command runs was imported before)."""
    _, _, module, *arguments = command
    monkeypatch.setattr(sys, "argv", [module, *arguments])
    with pytest.raises(SystemExit) as ended, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert ended.value.code == 0, shlex.join(command)


def test_the_recipe_goes_from_a_folder_of_text_to_transformers(tmp_path, monkeypatch, capsys):
    """The recipe's commands as written, one after the other, in a folder that holds
    `my_texts/` (8 files of the LINES): the training with TINY_TEXT_GPT added, and sampling, as
    new processes; the export and then the Python block, which loads the export in transformers
    and generates, in this one."""
    pytest.importorskip("transformers")
    pytest.importorskip("tiktoken")
    rng = random.Random(0)
    texts = ["\n".join(rng.choices(LINES, k=12)) for _ in range(8)]
    (tmp_path / "my_texts").mkdir()
    for index, text in enumerate(texts):
        (tmp_path / "my_texts" / f"{index}.txt").write_text(text)
    bpe = write_trained_tiktoken(tmp_path / "bpe.tiktoken", "\n".join(texts))
    recipe = readme_sections()[1]
    train, sample, export = shell_commands(recipe)
    assert train[1] == "train.py" and sample[1] == "sample.py" and export[1] == "-m", recipe

    run_as_written(train, tmp_path, *TINY_TEXT_GPT, f"data.tokenizer={bpe}")
    run_as_written(sample, tmp_path, "trainer.accelerator=cpu")
    monkeypatch.chdir(tmp_path)
    run_module_here(export, monkeypatch)
    capsys.readouterr()
    (python,) = FENCED_PYTHON.findall(recipe)
    exec(python, {})

    assert capsys.readouterr().out.startswith("To be")  # the prompt, then what the GPT wrote
