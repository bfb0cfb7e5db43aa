"""Course notebooks are stored without outputs (their execution is nbmake's job, see below)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "course").glob("*.ipynb")) + sorted((ROOT / "tests" / "notebooks").glob("*.ipynb"))
nbformat = pytest.importorskip("nbformat")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs"


# Execution: `python -m pytest` collects every notebook under course/ and tests/notebooks/ with nbmake
# (pyproject: --nbmake, testpaths include course/), so each chapter runs headless in CI.
