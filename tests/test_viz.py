"""mini3d.course.viz without a browser: figure data equals the data passed in, and every explorer's controls
move its figure in the expected direction (with closed-form fakes for the simulator, estimator and
planner, so these tests do not depend on mini3d.pp / mini3d.diagnose / mini3d.cost)."""

from __future__ import annotations

import math
from collections import namedtuple
from fractions import Fraction

import pytest

from mini3d.grid import Grid
from mini3d.pp.schedules import make_schedule
from mini3d.pp.simulator import simulate
from mini3d.course.viz import comm, grid3d, memory, pipeline, tp, widgets
from mini3d.course.viz.adapters import pp_simulate_fn
from mini3d.course.viz.theme import CATEGORIES, GIB, TEMPLATE_NAME, as_breakdown

pytestmark = pytest.mark.timeout(60)


def _trace(fig, name):
    found = [t for t in fig.data if t.name == name]
    assert len(found) == 1, [t.name for t in fig.data]
    return found[0]


def _titles_have_units(fig, axes="xy"):
    """Numeric axes name their unit in parentheses (categorical axes such as 'pipeline rank' need none)."""
    for ax in (getattr(fig.layout, a + "axis") for a in axes):
        assert ax.title.text and "(" in ax.title.text and ")" in ax.title.text, ax.title.text


# ----------------------------------------------------------------- fakes (closed forms)


def gpipe_timeline(p, m, t_fwd=1.0, t_bwd=2.0):
    """GPipe's timeline from mini3d's simulator (the course draws what mini3d.pp computes)."""
    return simulate(make_schedule("gpipe", p, m), t_fwd, t_bwd).timeline


def fake_simulate(kind, p, m, v=1, bwd_ratio=2.0):
    """GPipe timeline; bubble from the closed forms; refuses 1f1b with m < p like mini3d.pp."""
    if kind == "1f1b" and m < p:
        raise ValueError(f"1f1b needs micro_batches >= pp, got micro_batches={m} < pp={p}")
    tl = gpipe_timeline(p, m, 1.0, bwd_ratio)
    vv = v if kind == "interleaved" else 1
    return {"timeline": tl, "bubble_fraction": (p - 1) / (vv * m + p - 1)}


def fake_estimate(model="gpt-7b", tp=1, pp=1, dp=1, zero=0, micro_batches=1, recompute="none", dtype="bf16"):
    """Mixed-precision Adam bytes of a 7e9-parameter model split by tp*pp, ZeRO-sharded over dp."""
    n = 7e9 / (tp * pp)
    act = 20 * GIB / tp / (4 if recompute == "full" else 1)
    return {"params": 2 * n / (dp if zero >= 3 else 1), "grads": 2 * n / (dp if zero >= 2 else 1),
            "optimizer": 12 * n / (dp if zero >= 1 else 1), "activations": act, "comm_buffers": 0.5 * GIB}


def fake_plan(model="llama-3.1-70b", gpus=64, gpu_mem_gib=80):
    """Every (tp, pp) with tp*pp | gpus; step time falls with dp, memory with tp*pp."""
    rows = []
    for t in (1, 2, 4, 8):
        for p in (1, 2, 4, 8):
            if gpus % (t * p):
                continue
            mem = 1120 * GIB / (t * p)
            rows.append(dict(tp=t, pp=p, dp=gpus // (t * p), memory_bytes=mem,
                             step_time_s=1000.0 / gpus * (1 + 0.05 * t + 0.1 * p), fits=mem <= gpu_mem_gib * GIB))
    return rows


# ----------------------------------------------------------------- static figures


def test_template_and_breakdown_input():
    import plotly.io as pio

    assert TEMPLATE_NAME in pio.templates
    Est = namedtuple("Est", CATEGORIES)
    assert as_breakdown(Est(1, 2, 3, 4, 5)) == dict(zip(CATEGORIES, (1.0, 2.0, 3.0, 4.0, 5.0)))
    assert as_breakdown({"params": 7})["grads"] == 0.0
    with pytest.raises(ValueError, match="optimiser"):
        as_breakdown({"optimiser": 1})


def test_memory_breakdown_bars_capacity_and_oom():
    small = {"params": 2 * GIB, "grads": 2 * GIB, "optimizer": 12 * GIB, "activations": 4 * GIB}
    big = {c: 30 * GIB for c in CATEGORIES}
    fig = memory.memory_breakdown_figure({"tp=8": small, "tp=1": big}, capacity_bytes=80 * GIB)
    _titles_have_units(fig, "y")
    assert fig.layout.barmode == "stack"
    assert list(_trace(fig, "optimizer state").y) == [12.0, 30.0]  # GiB, in the order given
    assert list(_trace(fig, "comm buffers").y) == [0.0, 30.0]
    totals = _trace(fig, "total").text
    assert totals[0] == "20.0 GiB" and totals[1] == "150.0 GiB OOM"
    (line,) = fig.layout.shapes
    assert line.y0 == line.y1 == 80.0


def test_zero_and_recompute_figures():
    by_stage = {s: fake_estimate(dp=8, zero=s) for s in range(4)}
    fig = memory.zero_memory_figure(by_stage, 80 * GIB, dp=8)
    _titles_have_units(fig, "y")
    assert list(_trace(fig, "parameters").x) == ["no ZeRO", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    opt = list(_trace(fig, "optimizer state").y)
    assert opt[0] == pytest.approx(8 * opt[1]) and opt[1] == opt[2] == opt[3]
    rows = [dict(policy="none", activation_bytes=40 * GIB, compute_factor=1.0),
            dict(policy="full", activation_bytes=4 * GIB, compute_factor=1.33)]
    fig = memory.recompute_figure(rows)
    _titles_have_units(fig)
    assert list(fig.data[0].y) == [40.0, 4.0] and list(fig.data[0].text) == ["none", "full"]


def test_gantt_one_bar_per_action_and_bubble_annotation():
    p, m = 4, 6
    tl = gpipe_timeline(p, m, 1.0, 2.0)
    # The simulated GPipe timeline has exactly the textbook bubble.
    assert pipeline.bubble_from_timeline(tl) == pytest.approx(float(Fraction(p - 1, m + p - 1)))
    fig = pipeline.gantt_figure(tl, bubble_fraction=0.1234, formula="(p-1)/(m+p-1) = 3/9")
    _titles_have_units(fig, "x")
    assert len(_trace(fig, "forward").x) == p * m and len(_trace(fig, "backward").x) == p * m
    assert fig.layout.meta["bubble_fraction"] == 0.1234  # the value passed in, not recomputed
    assert fig.layout.annotations[0].text.startswith("bubble = 12.3%")
    assert "3/9" in fig.layout.annotations[0].text
    # Idle bars fill exactly the bubble: idle area / (p * makespan).
    idle = _trace(fig, "idle")
    makespan = (m + p - 1) * 3.0
    assert sum(idle.x) / (p * makespan) == pytest.approx((p - 1) / (m + p - 1))


def test_gantt_accepts_actions_dicts_and_strings():
    Action = namedtuple("Action", "op stage mb peer")
    tl = [[(0, 1, Action("F", 0, 0, None)), (1, 2, Action("SEND_F", 0, 0, 1)), (4, 6, {"op": "B", "stage": 0, "mb": 0})],
          [(2, 3, "F1.0"), (3, 5, "B1.0"), (5, 5.5, "sB1.0>0")]]
    assert pipeline.parse_action("rF1.7<0") == ("RECV_F", 1, 7)
    assert pipeline.idle_gaps(tl) == [[(1.0, 4.0)], [(0.0, 2.0), (5.0, 6.0)]]  # a send is not compute
    fig = pipeline.gantt_figure(tl)
    assert len(_trace(fig, "transfer").x) == 2
    assert fig.layout.meta["bubble_fraction"] == pytest.approx(6.0 / 12.0)  # computed when not given
    with pytest.raises(ValueError, match="X9"):
        pipeline.parse_action("X9")


def test_rank_cube_groups_and_nodes():
    g = Grid(tp=2, pp=2, dp=2)
    fig = grid3d.rank_cube_figure(g, color_by="tp", gpus_per_node=4)
    groups = [t for t in fig.data if t.name.startswith("tp group")]
    nodes = [t for t in fig.data if t.name.startswith("node")]
    assert len(groups) == 4 and len(nodes) == 2
    assert sorted(sorted(int(r) for r in t.text) for t in groups) == g.groups("tp")
    for t in groups:  # members differ only in their tp coordinate
        assert len(set(t.y)) == 1 and len(set(t.z)) == 1 and sorted(t.x) == [0, 1]
    assert "(" in fig.layout.scene.xaxis.title.text
    fig = grid3d.rank_cube_figure(grid3d.rank_points(g), color_by="pp")
    assert sorted(sorted(int(r) for r in t.text) for t in fig.data) == g.groups("pp")
    with pytest.raises(ValueError, match="color_by"):
        grid3d.rank_cube_figure(g, color_by="x")


def test_comm_figures():
    fig = comm.comm_volume_figure({"tp": 4 * 2**20, "dp": 8 * 2**20})
    _titles_have_units(fig, "y")
    assert list(fig.data[0].y) == [4.0, 8.0]
    fig = comm.comm_volume_figure({"tp": {"all_reduce": 2**20}, "dp": {"all_reduce": 2**20, "reduce_scatter": 2**21}})
    assert list(_trace(fig, "reduce_scatter").y) == [0.0, 2.0]
    assert not hasattr(comm, "ring_allreduce_time")  # one owner: Hardware.collective_s
    fig = comm.ring_allreduce_figure(1e9, [2, 4, 8, 64], {"NVLink": 300, "IB": 25})
    _titles_have_units(fig)
    nv, ib = (list(t.y) for t in fig.data)
    assert nv == sorted(nv) and all(b > a for a, b in zip(nv, ib))  # grows with n; slower link slower
    assert ib[-1] < 2 * 1e9 / 25e9 * 1e3  # bounded by 2 S / B (ms)
    fig = comm.scaling_efficiency_figure([8, 64, 1024], [0.95, 0.8, 0.49])
    _titles_have_units(fig)
    assert fig.layout.annotations[0].text == "1024 GPUs work like 502"


def test_tp_shards():
    z = tp.shard_owner_grid(64, 256, "col", 4)
    assert all(row == z[0] for row in z) and [z[0].count(r) for r in range(4)] == [4, 4, 4, 4]
    assert z[0] == sorted(z[0])  # contiguous column slices, rank 0 first
    z = tp.shard_owner_grid(256, 64, "row", 4)
    assert [row[0] for row in z] == sorted(row[0] for row in z) and {v for row in z for v in row} == {0, 1, 2, 3}
    assert all(len(set(row)) == 1 for row in z)
    assert {v for row in tp.shard_owner_grid(8, 8, "none", 2) for v in row} == {-1}
    with pytest.raises(ValueError, match="tp=3"):
        tp.shard_owner_grid(64, 256, "col", 3)
    fig = tp.tp_shard_figure(tp.megatron_mlp(64) + tp.megatron_attention(64), tp=2)
    assert len(fig.data) == 4 and "column" not in fig.layout.annotations[0].text
    assert "col-parallel" in fig.layout.annotations[0].text and "row-parallel" in fig.layout.annotations[1].text


# ----------------------------------------------------------------- explorers


def _bubble(w):
    return w.figure.layout.meta["bubble_fraction"]


def test_schedule_explorer_directions_and_errors():
    w = widgets.schedule_explorer(fake_simulate, kind="gpipe", p=4, m=4)
    assert _bubble(w) == pytest.approx(3 / 7)
    assert w.figure.layout.annotations[0].text.startswith("bubble = 42.9%")
    w.controls["m"].value = 16  # more micro-batches -> smaller bubble, more bars
    assert _bubble(w) == pytest.approx(3 / 19)
    assert len(_trace(w.figure, "forward").x) == 4 * 16
    w.controls["p"].value = 8  # more stages -> bigger bubble
    assert _bubble(w) == pytest.approx(7 / 23)
    w.controls["kind"].value = "interleaved"
    before = _bubble(w)
    w.controls["v"].value = 4  # more chunks per rank -> smaller bubble
    assert _bubble(w) < before and "v·m" in w.figure.layout.annotations[0].text
    w.controls["kind"].value = "1f1b"
    w.controls["m"].value = 2  # invalid for 1f1b: status names it, the figure keeps its last picture
    assert "micro_batches=2 < pp=8" in w.status.value
    assert _bubble(w) == pytest.approx(7 / 23)


def test_memory_calculator_directions():
    w = widgets.memory_calculator(fake_estimate, capacity_gib=80)
    total = lambda: sum(sum(t.y) for t in w.figure.data if t.type == "bar")  # noqa: E731
    start = total()
    assert "does not fit" in w.status.value and start > 80
    w.controls["tp"].value = 8
    assert total() < start
    w.controls["zero"].value = 3
    w.controls["recompute"].value = "full"
    assert total() < 80 and "fits" in w.status.value and "does not" not in w.status.value
    assert len(w.figure.layout.shapes) == 1  # the capacity line survives redraws


def test_zero_explorer_directions():
    w = widgets.zero_explorer(fake_estimate, capacity_gib=80)
    per_rank = lambda: sum(t.y[0] for t in w.figure.data if t.type == "bar")  # noqa: E731
    seen = []
    for stage in range(4):
        w.controls["zero"].value = stage
        seen.append(per_rank())
    assert all(b < a for a, b in zip(seen, seen[1:])), seen  # each stage shards more
    assert len(_trace(w.figure, "parameters").x) == 8  # one bar per dp rank
    w.controls["dp"].value = 64
    assert len(_trace(w.figure, "parameters").x) == 64 and per_rank() < seen[-1]


def test_planner_explorer_directions():
    w = widgets.planner_explorer(fake_plan)
    best64 = w.figure.layout.meta["best"]
    assert best64["fits"] and best64["tp"] * best64["pp"] >= 14  # 1120 GiB / 80 GiB
    w.controls["gpus"].value = 512
    assert w.figure.layout.meta["best"]["step_time_s"] < best64["step_time_s"]
    w.controls["gpu_mem_gib"].value = 24
    w.controls["gpus"].value = 8
    assert w.figure.layout.meta["best"] is None and w.status.value == "no plan fits"
    assert len(_trace(w.figure, "fits").x) == 0


def test_pp_adapter():
    sim = pp_simulate_fn()
    for m in (4, 8):
        out = widgets.schedule_view(sim, "gpipe", 4, m, 1, 2.0)
        # With equal per-stage costs and no p2p time, GPipe's simulated bubble is the closed form.
        assert out["bubble_fraction"] == pytest.approx((4 - 1) / (m + 4 - 1))
    a = widgets.schedule_view(sim, "interleaved", 4, 8, 2, 2.0)["bubble_fraction"]
    assert a == pytest.approx(3 / (2 * 8 + 3))


def test_estimator_adapter():
    from mini3d.course.viz.adapters import estimate_fn

    fn = estimate_fn(seq_len=2048)
    totals = [as_breakdown(fn(model="gpt-7b", dp=8, zero=z)) for z in range(4)]
    sums = [sum(t.values()) for t in totals]
    assert all(b < a for a, b in zip(sums, sums[1:])), sums
    with pytest.raises(ValueError, match="tp=3"):
        fn(model="gpt-7b", tp=3)
    assert math.isfinite(sums[0])


def test_zero_bubble_kinds_in_the_explorer_and_the_gantt():
    pytest.importorskip("mini3d.pp")
    assert {"looped-bfs", "zb-h1", "zbv"} <= set(pipeline.SCHEDULE_MENU)
    sim = pp_simulate_fn()
    zb = widgets.schedule_view(sim, "zb-h1", 4, 8, 2, 2.0)  # v ignored: one chunk per rank
    assert zb["bubble_fraction"] == pytest.approx(3 / 27) and "1/9" in zb["formula"]
    zbv = widgets.schedule_view(sim, "zbv", 4, 8, 1, 2.0)  # v forced to zbv's two chunks
    assert zbv["bubble_fraction"] < zb["bubble_fraction"] and "no closed form" in zbv["formula"]
    fig = pipeline.gantt_figure(zb["timeline"])
    assert len(_trace(fig, "weight").x) == 4 * 8  # one W bar per rank and micro-batch, own colour
    assert _trace(fig, "weight").marker.color != _trace(fig, "backward").marker.color
    plain = pipeline.gantt_figure(widgets.schedule_view(sim, "1f1b", 4, 8, 1, 2.0)["timeline"])
    assert "weight" not in [t.name for t in plain.data]


def test_figure_widget_opens_with_its_plotly_module(monkeypatch):
    """Every explorer figure is our FigureWidget, and the state its comm opens with carries plotly's
    bundle and a per-figure key (the browser loader's `initialize` reads both from that state; set
    after construction they would arrive only behind the deadline they exist to meet)."""
    import ipywidgets.widgets.widget as ipw
    import plotly.graph_objects as go

    from mini3d.course.viz.figure_widget import LOADER_ESM, FigureWidget, plotly_widget_bundle

    opened = []
    real = ipw.comm.create_comm
    monkeypatch.setattr(ipw.comm, "create_comm", lambda **kw: opened.append(kw["data"]["state"]) or real(**kw))
    a, b = FigureWidget(go.Figure(go.Bar(y=[1]))), FigureWidget()
    states = [s for s in opened if s.get("_anywidget_id", "").endswith("figure_widget.FigureWidget")]
    assert len(states) == 2 and states[0]["_esm"] == LOADER_ESM
    assert all(s["_plotly_esm"] == plotly_widget_bundle() and len(s["_plotly_esm"]) > 1e6 for s in states)
    assert states[0]["_figure_key"] != states[1]["_figure_key"]
    box = widgets.schedule_explorer(pp_simulate_fn(), kind="gpipe", p=2, m=2)
    assert isinstance(box.figure, FigureWidget) and isinstance(a, go.FigureWidget) and b.data == ()


def test_gantt_panels_legend_clear_of_panel_titles():
    """Chapter 05's three-schedule panels: the panel titles sit on top of each panel, so the legend
    goes right of the plots (a horizontal legend at y=1 was drawn over the first panel's title)."""
    from mini3d.course.viz.pipeline_measured import gantt_panels

    fig = gantt_panels({"a": gpipe_timeline(2, 2), "b": gpipe_timeline(2, 2)}, title="t")
    titles = [a for a in fig.layout.annotations if a.text.startswith(("a:", "b:"))]
    assert titles and fig.layout.legend.orientation != "h" and (fig.layout.legend.x is None or fig.layout.legend.x >= 1)
