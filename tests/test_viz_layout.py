"""Layout and units of the course figures that a figure object can show without a browser.

The browser test (tests/test_browser.py) sees overlaps on the rendered SVG; these pin the settings
that prevent the ones issue #32 found: the 3D cube clipped by the camera, bucket labels drawn over
each other, slider labels cut short, and memory printed in GB (1e9) next to GiB (2**30).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import ipywidgets as W
import pytest

pytest.importorskip("plotly")

from mini3d.course.viz import dp_overlap, grid3d, theme, widgets  # noqa: E402
from mini3d.grid import Grid  # noqa: E402

VIZ = Path(theme.__file__).resolve().parent


def test_gib_is_the_memory_formatter():
    assert theme.gib(80 * 2**30) == "80.0 GiB" and theme.gib(1.5 * 2**30, 0) == "2 GiB"
    assert theme.gib(80e9, 1) == "74.5 GiB"  # an "80 GB" card counted in bytes of 1e9


def test_no_decimal_gigabytes_for_memory_in_the_viz_code():
    """Memory goes through GIB / gib(); 1e9 may only scale a rate (GB/s, Gbps, FLOP/s)."""
    rate = re.compile(r"gbps|GB/s|bandwidth|_bw\b|flop|TFLOP|GFLOP", re.I)
    bad = []
    for path in sorted(VIZ.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            decimal = re.search(r"\b\d+(\.\d+)?e9\b|\"GB\"|'GB'|\bGB\b(?!/s)", code)
            if decimal and not rate.search(code) and '"""' not in line and path.name != "theme.py":
                bad.append(f"{path.name}:{n}: {line.strip()}")
    assert not bad, "memory in decimal GB (use theme.GIB / theme.gib):\n" + "\n".join(bad)


def test_rank_cube_fits_its_cell():
    fig = grid3d.rank_cube_figure(Grid(tp=4, pp=2, dp=4), color_by="pp", gpus_per_node=8)
    scene = fig.layout.scene
    eye = scene.camera.eye
    assert eye.x is not None, "plotly's default camera: it clips the cube's near corner"
    # plotly's default eye (1.25, 1.25, 1.25), 2.17 from the centre, clipped the cube's near corner
    assert math.dist((0, 0, 0), (eye.x, eye.y, eye.z)) >= 2.5 and scene.aspectmode == "cube"
    assert fig.layout.height >= 520 and fig.layout.width is None  # the cell's width, never wider
    m = fig.layout.margin
    assert m.l <= 20 and m.r <= 20 and m.b <= 20 and m.t >= 50  # the scene, not blank margins; the title's row


def test_dp_overlap_bucket_names_only_on_hover():
    win = [dict(step=s, t1=0.05, buckets=[(0.02 + 0.003 * i, 0.03, 1e5) for i in range(8)]) for s in (1, 2)]
    fig = dp_overlap.dp_overlap_figure({"small buckets": win})
    buckets = fig.data[1]
    assert buckets.textposition == "none" and "%{text}" in buckets.hovertemplate
    assert fig.layout.height >= 120 + 40 * 2  # room for every (run, step) row


def test_wired_controls_show_their_whole_label():
    controls = {"a": W.SelectionSlider(options=[8, 16], description="global batch"),
                "b": W.Dropdown(options=["x"], description="recompute policy"),
                "c": W.IntSlider(description="micro-batches")}
    widgets.wire(controls, W.HTML(), lambda: None)
    assert all(c.style.description_width == "initial" for c in controls.values())
