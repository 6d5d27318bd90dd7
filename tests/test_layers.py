"""The folders of src/ are layers: each imports only from its own layer and the ones below it,
there are no import circles, and only the entry points (train.py, eval.py, sample.py, plan.py,
hydra_plugins/) import launch/. Imports are read with ast, the ones inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

# Bottom to top: a module may import from its own layer and the layers before it.
LAYERS = (
    "config",
    "runtime",
    "components",
    "checkpoint",
    "parallel",
    "planning",
    "observe",
    "training",
    "launch",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports (`from src.x import y` counts src.x.y if y is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def project_graph() -> dict[str, set[str]]:
    entry_points = [ROOT / f"{name}.py" for name in ("train", "eval", "sample", "plan")]
    files = [*(ROOT / "src").rglob("*.py"), *entry_points]
    files += (ROOT / "hydra_plugins").rglob("*.py")
    modules = {module_name(path): path for path in files}
    return {name: imported_modules(path, set(modules)) for name, path in modules.items()}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "src" and len(parts) > 1 else None


def test_every_module_of_src_sits_in_a_layer():
    assert {layer(module) for module in project_graph() if module.startswith("src.")} == set(LAYERS)


def test_layers_import_downwards_only():
    upward = [
        f"{module} -> {target}"
        for module, targets in project_graph().items()
        if layer(module)
        for target in targets
        if layer(target) and LAYERS.index(layer(target)) > LAYERS.index(layer(module))
    ]
    assert upward == []


def test_only_the_entry_points_import_launch():
    importers = {
        module
        for module, targets in project_graph().items()
        if any(layer(target) == "launch" for target in targets) and layer(module) != "launch"
    }
    plugins = {m for m in importers if m.startswith("hydra_plugins")}
    assert importers <= {"train", "eval", "sample", "plan", *plugins}


def test_runtime_and_config_import_nothing_from_the_project_above_them():
    graph = project_graph()
    for module, targets in graph.items():
        if layer(module) in ("config", "runtime"):
            assert {layer(target) for target in targets} <= {layer(module)}, module


def test_there_are_no_import_circles():
    graph = project_graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError(" -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_reading_finds_imports_of_modules_and_packages():
    """The ast reading finds the imports these tests judge, so that they can fail."""
    graph = project_graph()
    assert "src.runtime.ranks" in graph["src.launch.as_rank"]
    assert "src.parallel" in graph["src.training.checks"]  # the package
    assert (
        "src.components.batches" in graph["src.components.data_contract"]
    )  # from src.components import


def test_one_module_spells_out_the_run_folders_file_names():
    names = ('"summary.json"', '"metrics.jsonl"', '"status.json"', '"checkpoints"', '".hydra"')
    owner = ROOT / "src" / "runtime" / "run_folder.py"
    spelt = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in (ROOT / "src").rglob("*.py")
        if path != owner
        for name in names
        if name in path.read_text()
    ]
    assert spelt == []
