"""Every name has one address: no module re-exports another's names (`noqa: F401`), and every
dotted `mini3d.x.y` name written in the package's docstrings and comments or in the docs resolves."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_module_re_exports_a_name():
    """A caller imports a name from the module that owns it; an unused import silenced with
    `noqa: F401` is a second address for it (and drifts when the owner moves)."""
    sites = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "mini3d").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if "noqa: F401" in line]
    assert not sites, sites


def _written_names():
    """(file, dotted name) for every `mini3d.x.y` in mini3d's docstrings and comments and in the docs,
    and in the docs every backticked `x.y` whose first part is one of mini3d's units."""
    import io
    import re
    import tokenize

    pattern = re.compile(r"\bmini3d(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
    for path in sorted((ROOT / "mini3d").rglob("*.py")):
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                for name in pattern.findall(tok.string):
                    yield path.relative_to(ROOT).as_posix(), name
    units = {p.stem for p in (ROOT / "mini3d").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    short = re.compile(r"`([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")  # `cost.memory.state_bytes`
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "course" / "README.md"]:
        text = path.read_text()
        for name in pattern.findall(text):
            yield path.relative_to(ROOT).as_posix(), name
        for name in short.findall(text):  # a unit's name written without `mini3d.` (not a file name)
            if name.split(".")[0] in units and name.rsplit(".", 1)[1] not in ("py", "md"):
                yield path.relative_to(ROOT).as_posix(), f"mini3d.{name}"


def _resolves(name: str) -> bool:
    """The longest importable prefix is a module; each remaining part is an attribute of it."""
    import importlib

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_written_mini3d_name_resolves():
    """A docstring, comment or doc naming `mini3d.x.y` points at a module or attribute that exists
    (the house moved by idea: `mini3d.launch.launch`, `mini3d.model.GPT` went stale)."""
    stale = sorted({f"{where}: {name}" for where, name in _written_names() if not _resolves(name)})
    assert not stale, "\n".join(stale)


def test_one_import_style():
    """The package imports itself absolutely (`from mini3d.x import y`): a module reads the same
    wherever it sits, and a move is a rename, not a rewrite of its imports."""
    import ast
    from pathlib import Path

    relative = [f"{p.relative_to(Path(__file__).parents[1])}:{n.lineno}"
                for p in sorted((Path(__file__).parents[1] / "mini3d").rglob("*.py"))
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative, relative
