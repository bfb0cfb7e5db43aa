"""Course notebooks: stored without outputs, and each executes headless top to bottom."""

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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_executes_headless(path):
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(path, as_version=4)
    # The kernel starts in the repository root, so `import mini3d` finds this checkout.
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
