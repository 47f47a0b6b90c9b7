"""The package's tree draws its architecture, and a test keeps it so.

Layers, lowest first: ``core`` < ``model`` < ``run`` < ``judge`` < ``report`` < ``pipeline`` (with
``session``) < the entry points (``cli``, ``plugin``, ``__main__``). A module may import its own layer and
the layers below it, never a higher one, and no modules import each other in a cycle. Every import counts:
the ones inside functions, and the ones under ``if TYPE_CHECKING:`` (a type-only import still ties the two
modules: a circle of them is a design that cannot be split).

A scheme is one record (``commgate.model.schemes.SCHEMES``) and a trainer another (``TRAINERS``): no module
outside the records compares a scheme's name as a string or spells one in a hint, and each record has its
entry in the run layer's registry (``commgate.run.workloads``), where a workload is imported by a function
the walker sees, never by a ``module:attribute`` string.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "harness" / "commgate"
LAYERS = ("core", "model", "run", "judge", "report", "pipeline", "entry")
ENTRY = {"cli", "plugin", "__main__", "__init__", "examples", "capture"}
"""The entry points, ``examples`` (what a user hands commgate: it may use all of it) and ``capture`` (what a
captured program calls)."""
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


def imports(path: Path) -> set[str]:
    """The commgate modules ``path`` imports: module-level, inside functions and under ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    known = {module_name(p) for p in PACKAGE.rglob("*.py")}
    for node in ast.walk(tree):
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
    assert imports(bad) == {"commgate.judge.gate", "commgate.report.report"}


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


RECORDS = {"commgate.model.schemes", "commgate.model.trainers"}
"""Where scheme and trainer names may be spelled: their records (and the run layer's registry keys)."""


def _scheme_names() -> set[str]:
    from commgate.model.schemes import SCHEMES

    return set(SCHEMES)


def _strings(node: ast.AST) -> list[str]:
    """The string constants a comparison operand holds (itself, or the items of a tuple, list or set)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def _scheme_aliases(tree: ast.AST, source: str) -> set[str]:
    """Names bound to a scheme's name: ``s = par.scheme``, ``P, s = "parallelism", par.scheme``."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (
                list(zip(target.elts, node.value.elts, strict=False))
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                else [(target, node.value)]
            )
            out |= {t.id for t, v in pairs if isinstance(t, ast.Name) and "scheme" in ast.get_source_segment(source, v)}
    return out


def compared_names(source: str, names: set[str]) -> list[str]:
    """Where ``source`` decides on a scheme's name: compares something scheme-like (an expression that
    reads a ``scheme``, a name bound to one) with one of ``names`` (``==``, ``!=``, ``in``, ``not in``,
    ``match``), tests membership in a tuple of scheme names, or spells one, quoted, after the word scheme
    in a message. ``"fsdp" in block`` (an option block named like a scheme) is not a decision on a scheme.
    Returns ``line: what`` each."""
    tree = ast.parse(source)
    aliases = _scheme_aliases(tree, source)

    def scheme_like(node: ast.AST) -> bool:
        return "scheme" in (ast.get_source_segment(source, node) or "") or (
            isinstance(node, ast.Name) and node.id in aliases
        )

    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
    }
    hint = re.compile(r"schemes? '(" + "|".join(re.escape(n) for n in sorted(names)) + r")'")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            strings = [(o, _strings(o)) for o in operands]
            spelled = [s for _, ss in strings for s in ss if s in names]
            several = any(len(ss) > 1 and set(ss) <= names for _, ss in strings)
            if spelled and (several or any(scheme_like(o) for o, ss in strings if not ss)):
                found.append(f"{node.lineno}: compares with {spelled}")
        elif isinstance(node, ast.Match) and scheme_like(node.subject):
            spelled = [s for case in node.cases for n in ast.walk(case.pattern) for s in _strings(n) if s in names]
            if spelled:
                found.append(f"{node.lineno}: matches {spelled}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and (m := hint.search(node.value))
        ):
            found.append(f"{node.lineno}: spells {m.group(0)!r}")
    return found


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m not in RECORDS))
def test_no_scheme_name_is_compared_as_a_string_outside_the_records(module: str) -> None:
    path = PACKAGE.joinpath(*module.split(".")[1:])
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    found = compared_names(path.read_text(encoding="utf-8"), _scheme_names())
    assert not found, f"{module} decides on scheme names (a fact for the Scheme record): {found}"


def test_the_scheme_name_check_sees_planted_comparisons() -> None:
    planted = (
        'if par.scheme == "fsdp":\n    pass\n'
        'x = t in ("pp", "fsdp")\n'
        'P, s = "parallelism", par.scheme\n'
        'match s:\n    case "ddp":\n        pass\n'
        "msg = \"use scheme 'tp' instead\"\n"
        'ok = par.engine == "torch" and "fsdp" in block and s != "tp"\n'
    )
    found = compared_names(planted, {"fsdp", "pp", "ddp", "tp"})
    assert sorted(int(f.split(":")[0]) for f in found) == [1, 3, 5, 8, 9], found


def test_every_scheme_and_trainer_has_its_workload_in_the_run_layer() -> None:
    from commgate.model.schemes import SCHEMES
    from commgate.model.trainers import TRAINERS
    from commgate.run.workloads import TRAINER_WORKLOADS, WORKLOADS

    assert set(WORKLOADS) == set(SCHEMES)
    assert set(TRAINER_WORKLOADS) == set(TRAINERS)


def test_no_workload_is_named_by_a_module_string() -> None:
    """A ``module:attribute`` string naming commgate's own code is an import the walker cannot see."""
    spec = re.compile(r"^commgate(\.\w+)+:\w+$")
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not spec.match(node.value), f"{path}: {node.value!r}"
