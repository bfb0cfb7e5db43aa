"""Layout and units of the course figures that a figure object can show without a browser.

The browser test (tests/test_browser.py) sees overlaps on the rendered SVG; these pin the settings
that prevent the ones issue #32 found: the 3D cube clipped by the camera, bucket labels drawn over
each other, slider labels cut short, and memory printed in GB (1e9) next to GiB (2**30).
"""

from __future__ import annotations

import json
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


# A memory figure in decimal units: "67.5 GB", "1.3 TB", "140GB" (not a rate: GB/s; not a card's
# name: A100-80GB; not the marketing label a chapter quotes to explain it: "80 GB").
DECIMAL_MEMORY = re.compile(r'(?<![-\w.])(?<!")\d[\d.,]*(e\d+)?\s?[GT]B\b(?!/s)(?!")')
COURSE = VIZ.parents[2] / "course"


def test_the_decimal_memory_pattern():
    hits = [t for t in ("67.5 GB", "~1.3 TB", "eight 80 GB cards", "140GB", "A100-80GB", "25 GB/s",
                        '"80 GB" each', "80 GiB", "1,183 GiB") if DECIMAL_MEMORY.search(t)]
    assert hits == ["67.5 GB", "~1.3 TB", "eight 80 GB cards", "140GB"]


def test_the_prose_writes_memory_in_gib():
    """Every chapter's markdown, the course and exercises READMEs and the exercises' text."""
    bad = []
    for path in sorted(COURSE.glob("*.ipynb")):
        for n, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                bad += [f"{path.name} cell {n}: {m.group(0)!r}" for m in
                        DECIMAL_MEMORY.finditer("".join(cell["source"]))]
    exercises = COURSE.parent / "exercises"
    for path in [COURSE / "README.md", *sorted(exercises.glob("*.md")), *sorted(exercises.glob("*.py"))]:
        bad += [f"{path.name}: {m.group(0)!r}" for m in DECIMAL_MEMORY.finditer(path.read_text())]
    assert not bad, "memory in decimal GB/TB (write GiB, as theme.gib prints it):\n" + "\n".join(bad)


def test_the_planners_sentences_and_the_graders_write_memory_in_gib():
    """The planner's why-not, its cp hint, its comparison and its no-fit answer (what chapters 00
    and 09 print), and the course's graders: GiB through mini3d.cost.memory.gib, never GB."""
    from mini3d.config import Plan
    from mini3d.cost.hardware import PRESETS as GPUS
    from mini3d.cost.model import estimate_cost
    from mini3d.cost.planner import explain, search, why_not
    from mini3d.models.presets import PRESETS

    a100 = GPUS["A100-80GB"]
    cfg = PRESETS["gpt-7b"]
    est = {z: estimate_cost(cfg, Plan(dp=8, zero=z, global_batch=32, micro_batches=4, dtype="bf16"), a100)
           for z in (2, 3)}
    long = estimate_cost(cfg, Plan(dp=8, zero=3, global_batch=256, micro_batches=4, seq_len=4096,
                                   dtype="bf16"), a100)  # activations dominate: the cp hint
    texts = [why_not(est[3]), why_not(est[2]), why_not(long), explain(est[3], est[2]),
             search(PRESETS["gpt-175b"], 2, GPUS["A100-40GB"], global_batch=2, suggest=False).explanation]
    assert est[3].fits and not long.fits and "with cp=" in texts[2], texts
    code = re.compile(r"(?:^|[^\dA-Za-z-])GB\b(?!/s)|\d\s+GB\b(?!/s)")
    bad = [t for t in texts if code.search(t) or DECIMAL_MEMORY.search(t) or "GiB" not in t]
    graders = VIZ.parent / "grading"
    bad += [f"{p.name}:{n}: {line.strip()}" for p in sorted(graders.glob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if code.search(line)]
    assert not bad, "\n".join(bad)


def _figures():
    """One figure of each kind the issue found a layout defect in (02, 05, 07, 09 and the 70B story
    every chapter shows), at the sizes that broke them: one row, two ranks, a long axis title."""
    from mini3d.config import PRESETS, Plan
    from mini3d.cost.hardware import PRESETS as GPUS
    from mini3d.cost.model import estimate_cost
    from mini3d.course.viz import (comm, grid2d, long_sequences, memory, pipeline, planning,
                                   recompute_tradeoff, story70b)
    from tests.test_viz import gpipe_timeline

    mib = 2**20
    win = [dict(step=1, t1=0.05, buckets=[(0.02 + 0.003 * i, 0.03, 1e5) for i in range(8)])]
    yield "02 dp_overlap, one row", dp_overlap.dp_overlap_figure({"small buckets": win})
    yield "02 ring all-reduce", comm.ring_allreduce_figure(1e9, [2, 4, 8, 64], {"NVLink": 300, "IB": 25})
    yield "05 gantt, p=2", pipeline.gantt_figure(gpipe_timeline(2, 4), formula="(p-1)/(m+p-1) = 1/5")
    yield "05 gantt, p=4", pipeline.gantt_figure(gpipe_timeline(4, 8))
    yield "06 rank grid, one stage", grid2d.rank_grid_2d_figure(Grid(tp=2, pp=1, dp=2))
    yield "07 recompute", memory.recompute_figure(
        [dict(policy="none", activation_bytes=40 * theme.GIB, compute_factor=1.0),
         dict(policy="full", activation_bytes=4 * theme.GIB, compute_factor=1.33)])
    yield "07 measured vs estimated", recompute_tradeoff.measured_vs_estimated_figure(
        [dict(policy="none", measured_bytes=3 * mib, estimated_bytes=2.5 * mib, compute_factor=1.0,
              measured_time_factor=1.0),
         dict(policy="full", measured_bytes=0.5 * mib, estimated_bytes=0.5 * mib, compute_factor=1.33)])
    yield "07b ring steps, cp=2", long_sequences.ring_steps_figure(2)
    yield "07b zig-zag, cp=2", long_sequences.zigzag_figure(2)
    yield "09 scaling", comm.scaling_efficiency_figure([8, 64, 1024], [0.95, 0.8, 0.64])
    est = estimate_cost(PRESETS["llama-3.1-70b"], Plan(tp=4, pp=4, dp=2, global_batch=32,
                                                        micro_batches=8, seq_len=4096, dtype="bf16"),
                        GPUS["A100-80GB"])
    yield "09 time breakdown", planning.time_breakdown_figure([planning._row(est, "x"), planning._row(est, "y")])
    from mini3d.course.experts import kv_cache_rows
    from mini3d.course.viz.experts import kv_cache_figure
    yield "10 kv cache", kv_cache_figure(kv_cache_rows(PRESETS["deepseek-v3"], 4096), 4096, "deepseek-v3")
    yield "the 70B story", story70b.story_figure(story70b.story_rows({"a": dict(dp=8), "b": dict(tp=8, pp=2)}))


def _resolved(fig, path: str, key: str):
    """A layout value as drawn: the figure's own, else the template's (mini3d's theme)."""
    own = fig.layout[path][key]
    return own if own is not None else fig.layout.template.layout[path.rstrip("0123456789")][key]


def test_every_figure_keeps_the_layout_rules():
    """theme.py's rules, on the figure objects: the legend right of the plot (not in the title's
    band, where 05's and the story's legends wrapped over the title, nor under the x axis); a plot
    area of at least MIN_ROW_PX per row of subplots (02's bucket chart had 40 px at one row, its
    ticks on top of each other); automargin on every axis; a y title that fits along its axis
    (07's "saved for backward (MiB per layer per micro-batch)" was clipped at both ends)."""
    bad = []
    for name, fig in _figures():
        layout = fig.layout
        if layout.showlegend is not False and len(fig.data) > 1:
            x, anchor = _resolved(fig, "legend", "x"), _resolved(fig, "legend", "xanchor")
            orient = _resolved(fig, "legend", "orientation")
            if not (x is not None and x >= 1 and anchor == "left" and orient == "v"):
                bad.append(f"{name}: legend at x={x} ({anchor}, {orient}), not right of the plot")
        height = layout.height or 450
        plot = height - _resolved(fig, "margin", "t") - _resolved(fig, "margin", "b")
        axes = [k for k in layout.to_plotly_json() if k.startswith(("xaxis", "yaxis"))] or ["xaxis", "yaxis"]
        rows = len({tuple(layout[k].domain or (0, 1)) for k in axes if k.startswith("yaxis")}) or 1
        if plot / rows < theme.MIN_ROW_PX:
            bad.append(f"{name}: {plot / rows:.0f} px of plot per row (< {theme.MIN_ROW_PX})")
        for k in axes:
            if _resolved(fig, k, "automargin") is not True:
                bad.append(f"{name}: {k} without automargin")
            title = layout[k].title.text or ""
            if k.startswith("yaxis") and len(title) * theme.AXIS_TITLE_PX > plot / rows:
                bad.append(f"{name}: {k} title {title!r} is longer than its axis ({plot / rows:.0f} px)")
    assert not bad, "\n".join(bad)


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
