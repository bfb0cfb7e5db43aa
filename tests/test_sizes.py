"""Files and functions that read in one sitting: no module over 300 lines, no function over 60.

HOT_FILES are being reworked on several branches at once (the trainer, the launcher, the CLI, the
configuration); they are exempt until those merges land and they can be split. Remove a file from
the list once it meets the limits: the test then keeps it there.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 300, 60
HOT_FILES = {"mini3d/train.py", "mini3d/launch.py", "mini3d/cli.py", "mini3d/config.py"}


def _modules():
    for path in sorted((ROOT / "mini3d").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in HOT_FILES:
            yield rel, path.read_text()


def test_no_module_over_300_lines():
    long = [f"{rel}: {len(text.splitlines())} lines" for rel, text in _modules()
            if len(text.splitlines()) > MAX_MODULE_LINES]
    assert not long


def test_no_function_over_60_lines():
    long = []
    for rel, text in _modules():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not long


def test_hot_files_exist():
    """The exemptions name real files (a renamed file must leave the list)."""
    assert all((ROOT / rel).is_file() for rel in HOT_FILES)
