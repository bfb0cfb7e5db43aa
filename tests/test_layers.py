"""The package's layers: the engine never imports the course, and the imports form no circle.

The engine is every module of `mini3d` outside `mini3d.course`. The first test imports each of them
in a fresh interpreter whose import system refuses `mini3d.course` (a `sys.meta_path` blocker), and
builds the CLI's parser there; the second walks the `import` statements (ast, lazy ones inside
functions included) and looks for a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mini3d"

pytestmark = pytest.mark.timeout(120)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
ENGINE = sorted(m for m in MODULES if not (m == "mini3d.course" or m.startswith("mini3d.course."))
                and m != "mini3d.__main__")  # importing __main__ runs the CLI

BLOCKED_IMPORT = """
import importlib, sys

class CourseBlocker:
    def find_spec(self, name, path=None, target=None):
        if name == "mini3d.course" or name.startswith("mini3d.course."):
            raise ImportError(f"engine imported the course: {name}")
        return None

sys.meta_path.insert(0, CourseBlocker())
for name in sys.argv[1:]:
    importlib.import_module(name)
from mini3d.cli import build_parser
build_parser()  # every subcommand registered, `grade` included
assert not [m for m in sys.modules if m.startswith("mini3d.course")]
print("ok", len(sys.argv) - 1)
"""


def test_engine_imports_nothing_of_the_course():
    assert "mini3d.cli" in ENGINE and "mini3d.run.train" in ENGINE and len(ENGINE) > 40
    out = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT, *ENGINE], cwd=ROOT, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == f"ok {len(ENGINE)}"


def test_the_blocker_catches_a_course_import(tmp_path):
    """The blocker is not a no-op: importing the grader under it fails."""
    out = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT, "mini3d.course.grading"], cwd=ROOT,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode != 0 and "engine imported the course: mini3d.course" in out.stderr


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path) -> set[str]:
    """The mini3d modules `module` imports, at top level or inside functions."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_pkg, node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # `import mini3d.x.y as z` names a module; trim attrs
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def package_graph() -> dict[str, set[str]]:
    """Every mini3d module -> the mini3d modules it imports."""
    return {m: imports_of(m, p) for m, p in MODULES.items()}


def unit(module: str) -> str:
    """The layer unit a module belongs to: its subpackage (mini3d.cost, mini3d.course, ...) or itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (PKG / parts[-1]).is_dir() else module


def test_no_import_cycle_between_modules():
    graph = package_graph()
    assert "mini3d.course.grading.core" in graph["mini3d.course.grading.runner"]
    assert "mini3d.pp.schedules" in graph["mini3d.pp.rules"]
    assert find_cycle(graph) is None


def test_no_import_cycle_between_subpackages():
    """E.g. cost/ may import nothing of diagnose/ once diagnose/ imports cost/ (memory and time are
    one cost model; diagnostics read it)."""
    graph: dict[str, set[str]] = {}
    for m, deps in package_graph().items():
        graph.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) != unit(m))
    assert "mini3d.cost" in graph["mini3d.diagnose"]
    assert find_cycle(graph) is None


# The house's layers, bottom to top (docs/ARCHITECTURE.md draws them). A unit (a top-level module or
# a subpackage) imports only units of its own layer or of layers below; every unit has a layer, so
# a new package has to be placed before it can land.
LAYERS = (
    ("foundations", {"mini3d", "mini3d.exits", "mini3d.comm_log", "mini3d.comm", "mini3d.wgrad",
                     "mini3d.recompute", "mini3d.optim", "mini3d.models", "mini3d.config", "mini3d.grid",
                     "mini3d.schedule_kinds", "mini3d.timeline_clock", "mini3d.graph_breaks"}),
    ("engine", {"mini3d.tp", "mini3d.cp", "mini3d.ep", "mini3d.pp", "mini3d.dp", "mini3d.launch",
                "mini3d.data", "mini3d.checkpoint"}),
    ("analysis", {"mini3d.cost"}),
    ("diagnostics", {"mini3d.diagnose"}),
    ("run shell", {"mini3d.run", "mini3d.cli", "mini3d.__main__"}),
    ("course", {"mini3d.course"}),
)


def layer_of(unit_name: str) -> int:
    for i, (_, units) in enumerate(LAYERS):
        if unit_name in units:
            return i
    raise AssertionError(f"{unit_name} has no layer in tests/test_layers.py LAYERS")


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} -> {d}" for m, deps in sorted(graph.items()) for d in sorted(deps)
            if layer_of(unit(d)) > layer_of(unit(m))]


def test_no_upward_arrow():
    """No exceptions: the run shell sits above the diagnostics it arms, the engine below both."""
    graph = package_graph()
    assert not upward_arrows(graph)
    assert upward_arrows({"mini3d.tp.layers": {"mini3d.run.train"}}) == ["mini3d.tp.layers -> mini3d.run.train"]


def test_the_top_level_is_small():
    """About a dozen top-level modules; everything else lives in a package named for its idea."""
    top = sorted(p.stem for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 12, top
