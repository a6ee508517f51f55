"""The house rules of ``spark_jobs/cdc_apply``, checked on the source text
(no imports run): the folders are the data flow, a room imports only from
rooms below it, no import cycle, no long function without a reason, and the
README's layout table names exactly the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "spark_jobs" / "cdc_apply"

LAYERS: list[set[str]] = [
    {"errors", "model", "status"},  # the vocabulary: canonical changes, error classes, statuses
    {"config"},  # settings, read from the environment here only
    {"runtime"},  # how a Spark driver starts
    {"archive"},  # files: listing, lines
    {"decode"},  # messages -> canonical changes, one module per format
    {"results"},  # what a run reports (JSON between tasks)
    {"ledger"},  # what was applied
    {"apply"},  # one table: compact, MERGE on the audit branch, gate
    {"batch", "maintenance", "asof"},  # a batch's life; table maintenance; a table as of a source position
    {"rebuild"},  # a source replayed from zero beside the live tables, compared
    {"cli", "demo"},  # entry points
]
"""Rooms (a package's sub-package, or a top-level module) from the bottom
up.  The README states the same rule."""
MAX_FUNCTION_LINES = 60
LONG_REASON = re.compile(r"\bLong because\b")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Project modules a file imports anywhere (also inside functions: a
    deferred import is still a dependency)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cdc_apply"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cdc_apply"))
    return {m for m in found if m in MODULES and m != "cdc_apply"}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer(room: str) -> int:
    for i, rooms in enumerate(LAYERS):
        if room in rooms:
            return i
    raise AssertionError(f"room {room!r} is in no layer of tests/test_layout.py: add it (and to the README's layout table)")


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def test_every_room_has_a_layer():
    for module in MODULES:
        if module != "cdc_apply":
            _layer(_room(module))


def test_rooms_import_only_from_rooms_below():
    wrong = [
        f"{m} imports {d}"
        for m, deps in sorted(GRAPH.items())
        if m != "cdc_apply"
        for d in sorted(deps)
        if _room(d) != _room(m) and _layer(_room(d)) >= _layer(_room(m))
    ]
    assert not wrong, "imports against the layering (README, 'Layout'):\n" + "\n".join(wrong)


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH.get(m, ())):
            if state.get(d) == 1:
                cycles.append(path[path.index(d) :] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_a_cycle_and_a_climb(tmp_path):
    """The two checks above can fail: a made-up graph with a cycle and an
    upward import is caught (guards against a check that sees nothing)."""
    saved = dict(GRAPH)
    try:
        GRAPH["cdc_apply.config"] = GRAPH["cdc_apply.config"] | {"cdc_apply.batch"}
        with pytest.raises(AssertionError, match=r"config imports cdc_apply\.batch"):
            test_rooms_import_only_from_rooms_below()
        with pytest.raises(AssertionError, match="import cycles"):
            test_no_import_cycle()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def test_no_long_function_without_a_reason():
    long = []
    for path in sorted((ROOT / "spark_jobs").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and not LONG_REASON.search(ast.get_docstring(node) or ""):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: split them, or say 'Long because ...' in the docstring:\n" + "\n".join(
        long
    )


def test_readme_layout_table_matches_the_tree():
    """Every row of the README's layout table names a file or folder that
    exists, and every module and sub-package of the package is named."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([^`]+)`", section, flags=re.M))
    missing = sorted(n for n in named if not (ROOT / n.rstrip("/")).exists())
    assert not missing, f"the README's layout table names what does not exist: {missing}"
    expected = {f"spark_jobs/cdc_apply/{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    expected |= {f"spark_jobs/cdc_apply/{p.name}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    unnamed = sorted(e for e in expected if e not in named)
    assert not unnamed, f"the README's layout table does not name: {unnamed}"
