"""Figures that read (issue: labels, colours, slow explorers), checked on the figure data.

The browser test (tests/test_browser.py) checks the rendered SVG; these tests pin the layout
decisions that keep it clean, without a browser: where the capacity label and the bubble annotation
go, that the y axis leaves room for the bar totals, that pending ops differ from every axis colour
in lightness and pattern (not in hue alone), that sliders report on release with a busy state, that
the chunks slider is off for schedules that ignore it, and what the memory calculator says.
"""

from __future__ import annotations

import pytest

from mini3d.course.viz import failures, memory, pipeline, widgets
from mini3d.course.viz.theme import AXIS_COLORS, GIB
from tests.test_viz import fake_estimate, fake_simulate, gpipe_timeline


def _lightness(hex_color: str) -> float:
    """Relative luminance (WCAG) of '#rrggbb', 0 (black) to 1 (white)."""
    rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def test_capacity_label_is_in_the_legend_and_totals_have_headroom():
    big = {"params": 100 * GIB, "grads": 20 * GIB}
    fig = memory.memory_breakdown_figure({"a": big, "b": {"params": GIB}}, capacity_bytes=80 * GIB)
    assert not fig.layout.annotations  # nothing written on the plot that a bar total could hit
    assert any(t.name == "GPU capacity 80 GiB" and t.mode == "lines" for t in fig.data)
    assert fig.layout.yaxis.range[1] >= 1.15 * 120 - 1e-9  # the "120.0 GiB OOM" text stays inside
    small = memory.memory_breakdown_figure({"a": {"params": GIB}}, capacity_bytes=80 * GIB)
    assert small.layout.yaxis.range[1] >= 80  # the capacity line is always visible


def test_gantt_title_bubble_and_legend_sit_in_separate_bands():
    fig = pipeline.gantt_figure(gpipe_timeline(4, 4), formula="(p-1)/(m+p-1) = 3/7")
    (note,) = fig.layout.annotations
    assert fig.layout.legend.x >= 1 and fig.layout.legend.xanchor == "left"  # right of the plot
    assert note.y == 1 and note.yanchor == "bottom" and note.yshift >= 30  # above the plot
    assert fig.layout.title.yanchor == "top" and fig.layout.margin.t >= note.yshift + 60


def test_interleaved_chunks_have_their_own_colour():
    from mini3d.course.viz.adapters import pp_simulate_fn

    res = pp_simulate_fn()("interleaved", 2, 4, 2, 2.0)
    fig = pipeline.gantt_figure(res.timeline)
    names = {t.name: t.marker.color for t in fig.data}
    assert {"forward", "forward chunk 1", "backward", "backward chunk 1"} <= set(names)
    assert len({names["forward"], names["forward chunk 1"], names["backward"], names["backward chunk 1"]}) == 4


def test_pending_ops_differ_from_every_axis_colour_without_hue():
    dumps = {0: {"coords": {"pp": 0}, "events": [
        {"rank": 0, "axis": "pp", "op": "send", "seq": 1, "start": 0.0, "end": 0.1},
        {"rank": 0, "axis": "pp", "op": "recv", "seq": 2, "start": 0.2, "end": None, "age_s": 1.0}]}}
    fig = failures.hang_timeline_figure(dumps)
    done = next(t for t in fig.data if t.name == "pp completed")
    pending = next(t for t in fig.data if t.name == "pp PENDING")
    assert pending.marker.pattern.shape  # hatched: visible in greyscale too
    for axis, color in AXIS_COLORS.items():
        assert abs(_lightness(pending.marker.color) - _lightness(color)) > 0.25, axis
    assert done.marker.color == AXIS_COLORS["pp"]


def test_explorers_update_on_release_and_show_a_busy_state():
    w = widgets.schedule_explorer(fake_simulate, kind="1f1b", p=4, m=4)
    sliders = [c for c in w.controls.values() if hasattr(c, "continuous_update")]
    assert sliders and all(not c.continuous_update for c in sliders)
    assert "mini3d-explorer" in w._dom_classes
    seen = []
    w.status.observe(lambda change: seen.append(change["new"]), names="value")
    w.controls["m"].value = 8
    assert seen[0] == widgets.BUSY and "bubble fraction" in seen[-1]


def test_chunks_slider_only_for_interleaved():
    w = widgets.schedule_explorer(fake_simulate, kind="1f1b", p=4, m=4, v=2)
    assert w.controls["v"].disabled
    w.controls["kind"].value = "interleaved"
    assert not w.controls["v"].disabled
    w.controls["kind"].value = "gpipe"
    assert w.controls["v"].disabled


@pytest.mark.parametrize("tp,pp,dp,expect", [
    (1, 1, 1, "1 GPU on 1 node of 8"),
    (8, 2, 4, "64 GPUs on 8 nodes of 8: tp inside a node; pp: 32 of 32 groups cross nodes"),
    (16, 1, 1, "16 GPUs on 2 nodes of 8: tp: 1 of 1 groups cross nodes"),
])
def test_memory_calculator_says_gpus_and_node_crossings(tp, pp, dp, expect):
    assert widgets.cluster_line(tp, pp, dp).startswith(expect)
    w = widgets.memory_calculator(fake_estimate, tp=tp, pp=pp, dp=dp)
    assert (w.controls["tp"].value, w.controls["pp"].value, w.controls["dp"].value) == (tp, pp, dp)
    assert expect in w.status.value


def test_zero_explorer_labels_one_total_however_many_ranks():
    w = widgets.zero_explorer(fake_estimate, capacity_gib=80)
    w.controls["dp"].value = 64  # 64 equal bars: 64 identical totals would print over each other
    (total,) = [t for t in w.figure.data if t.name == "total"]
    assert len(total.text) == 64 and [t for t in total.text if t] == [total.text[32]]


def test_rank_grid_2d_view_beside_the_cube():
    from mini3d.course.viz.grid2d import NODE_OUTLINES, rank_grid_2d_figure
    from mini3d.course.viz.grid_links import rank_grid_explorer
    from mini3d.grid import Grid

    fig = rank_grid_2d_figure(Grid(2, 2, 2), "tp", gpus_per_node=4)
    cells = fig.layout.meta["cells"]
    assert len(cells) == 8 and len({(c, r) for _, c, r, _ in cells}) == 8  # one square per rank
    assert {(rank, col, row) for rank, col, row, _ in cells} >= {(0, 0, 0), (1, 1, 0), (2, 2, 0), (4, 0, 1)}
    assert list(fig.data[0].marker.line.color[:5]) == [NODE_OUTLINES[0]] * 4 + [NODE_OUTLINES[1]]
    box = rank_grid_explorer(tp=2, pp=2, dp=2, gpus_per_node=4)
    box.controls["pp"].value = 4
    assert len(box.flat.layout.meta["cells"]) == 16 and box.flat in box.children[-1].children


def test_axes_grow_their_margins_instead_of_clipping_labels():
    import plotly.io as pio

    from mini3d.course.viz.theme import TEMPLATE_NAME

    layout = pio.templates[TEMPLATE_NAME].layout
    assert layout.xaxis.automargin is True and layout.yaxis.automargin is True


def test_explorer_figures_carry_their_picture_in_synced_state():
    """A view created after the first update draws from `_widget_data` / `_widget_layout` (the
    browser drops delta messages sent before plotly's module has loaded): both must hold the
    current picture after the first update and after every move, for every figure of the box."""
    from mini3d.course.viz.grid_links import rank_grid_explorer

    def state_is_current(fig):
        return (fig._widget_data == fig._data and len(fig._widget_data) > 0
                and fig._widget_layout == fig._layout_obj._props)

    w = widgets.schedule_explorer(fake_simulate, kind="1f1b", p=4, m=4)
    assert state_is_current(w.figure)
    w.controls["m"].value = 8
    assert state_is_current(w.figure) and list(w.figure._widget_data[0]["x"]) == list(w.figure.data[0].x)
    box = rank_grid_explorer(tp=2, pp=2, dp=2, gpus_per_node=4)
    box.controls["pp"].value = 4
    assert state_is_current(box.figure) and state_is_current(box.flat)
