"""The package layout the design promises (docs/design.md "Layers"): no import loops between files, no
architecture package importing another, shared parts never importing upward, and every child-process
entry point string naming a function that exists at its current path."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "conveyor"
SHARED = ("conveyor.envs", "conveyor.storage", "conveyor.models", "conveyor.returns", "conveyor.losses",
          "conveyor.algos", "conveyor.procs", "conveyor.config", "conveyor.presets", "conveyor.errors",
          "conveyor.hosts", "conveyor.files")
UPPER = ("conveyor.architectures", "conveyor.run", "conveyor.learner", "conveyor.cli", "conveyor.bench",
         "conveyor.telemetry", "conveyor.tracking", "conveyor.evaluate")


def module_files() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the conveyor modules it imports (imports inside functions included)."""
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_no_import_loops():
    graph = import_graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import loop: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for target in sorted(graph[node]):
            visit(target, path + [node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


def test_no_architecture_imports_another_and_shared_parts_never_import_upward():
    graph = import_graph()
    for module, targets in graph.items():
        parts = module.split(".")
        if len(parts) >= 3 and parts[1] == "architectures":
            own = ".".join(parts[:3])
            others = [t for t in targets if t.startswith("conveyor.architectures.") and not t.startswith(own + ".")
                      and t != own]
            assert not others, f"{module} imports another architecture: {others}"
        if module.startswith(SHARED):
            upward = [t for t in targets if t.startswith(UPPER)]
            assert not upward, f"shared part {module} imports upward: {upward}"


def test_every_child_entry_point_names_an_existing_function():
    pattern = re.compile(r'"from (conveyor[\w.]*) import (\w+); \2\(\)"')
    found = []
    for path in PACKAGE.rglob("*.py"):
        for module, function in pattern.findall(path.read_text()):
            found.append((module, function))
            assert callable(getattr(importlib.import_module(module), function, None)), f"{module}.{function}"
    assert len(found) >= 4, found  # env workers, HTS executors, GA3C agents, IMPACT workers


def test_host_sizing_imports_nothing_of_conveyors_but_errors():
    """hosts.py sits at the bottom of layer 1: presets.py sizes runs from it, so it may not import them back."""
    assert import_graph()["conveyor.hosts"] <= {"conveyor.errors"}
