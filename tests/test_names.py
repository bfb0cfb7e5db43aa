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
