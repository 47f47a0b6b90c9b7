"""The package's tree draws its architecture, and a test keeps it so.

Layers, lowest first: ``core`` < ``model`` < ``run`` < ``judge`` < ``report`` < ``pipeline`` (with
``session``) < the entry points (``cli``, ``plugin``, ``__main__``). A module may import its own layer and
the layers below it, never a higher one, and no modules import each other in a cycle. Every import counts,
the ones inside functions too; only imports under ``if TYPE_CHECKING:`` (annotations, never executed) are
exempt.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "harness" / "commgate"
LAYERS = ("core", "model", "run", "judge", "report", "pipeline", "entry")
ENTRY = {"cli", "plugin", "__main__", "__init__", "examples"}
"""The entry points, and ``examples`` (what a user hands commgate: it may use all of it)."""
PIPELINE = {"pipeline", "session"}
"""The pipeline layer's modules: a scenario's life (``pipeline``), and a run of scenarios (``session``)."""


def module_name(path: Path) -> str:
    parts = ["commgate", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:  # the package itself: only __version__
        return 0
    top = parts[1]
    return LAYERS.index("entry" if top in ENTRY else "pipeline" if top in PIPELINE else top)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path) -> set[str]:
    """The commgate modules ``path`` imports at run time (module-level and inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    found: set[str] = set()
    known = {module_name(p) for p in PACKAGE.rglob("*.py")}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "commgate")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "commgate":
            for a in node.names:  # `from commgate.core import schemas` imports the module commgate.core.schemas
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return found


GRAPH = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_layers_are_the_packages_folders() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {"core", "model", "run", "judge", "report", "examples"}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_module_imports_a_higher_layer(module: str) -> None:
    upward = sorted(m for m in GRAPH[module] if layer(m) > layer(module))
    assert not upward, f"{module} (layer {LAYERS[layer(module)]}) imports higher layers: {upward}"


def test_there_are_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in GRAPH[v]:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_walker_sees_a_planted_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from commgate.report.report import Report\n"
        "def f():\n    from commgate.judge.gate import judge\n"
    )
    assert imports(bad) == {"commgate.judge.gate"}


def test_nothing_named_harness_is_importable_from_outside_the_checkout(tmp_path: Path) -> None:
    code = (
        "import importlib.util, commgate, commgate.cli, commgate.plugin; "
        "print(importlib.util.find_spec('harness'), commgate.__version__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    spec, version = proc.stdout.split()
    assert spec == "None" and version


def test_python_dash_m_commgate_runs_from_outside_the_checkout(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "commgate", "--version"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("commgate "), proc.stderr
