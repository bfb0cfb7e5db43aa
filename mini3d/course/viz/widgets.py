"""ipywidgets explorers: controls + a `go.FigureWidget`, redrawn by calling a function you pass in.

Each explorer separates a pure *view* function (controls -> plain data, testable without a
browser) from the widget wiring. A chapter passes mini3d's own simulator / estimator / planner,
wrapped by `mini3d.course.viz.adapters`; tests pass closed-form fakes. Contracts of the passed functions:

    simulate_fn(kind, p, m, v, bwd_ratio) -> obj/dict with .timeline and .bubble_fraction
    estimate_fn(model=, tp=, pp=, dp=, zero=, micro_batches=, recompute=, dtype=) -> {category: bytes}
    plan_fn(model=, gpus=, gpu_mem_gib=) -> [{tp, pp, dp, memory_bytes, step_time_s, fits}, ...]

A ValueError raised by the function (e.g. "1f1b needs micro_batches >= pp") is shown in the
explorer's status line, and the figure keeps its last valid picture.
"""

from __future__ import annotations

import ipywidgets as W

from mini3d.schedule_kinds import schedule_kind

from mini3d.course.viz.memory import memory_breakdown_figure
from mini3d.course.viz.pipeline import (SCHEDULE_MENU, bubble_formula_text, chunks_for, fill_gantt,
                                        gantt_figure)
from mini3d.course.viz.theme import CAPACITY_COLOR, GIB, as_breakdown, new_figure, to_gib

POW2 = [1, 2, 4, 8, 16, 32, 64]


def _get(result, name):
    return result[name] if isinstance(result, dict) else getattr(result, name)


BUSY = "<i>computing...</i>"


def wire(controls: dict, status, update):
    """Call `update` when a control's value changes, showing BUSY in the status line meanwhile
    (`update` replaces it). Sliders report only where they are released (`continuous_update=False`),
    so a slow redraw never lags behind a slider still being dragged."""
    def on_change(change):
        status.value = BUSY
        update()
    for c in controls.values():
        if hasattr(c, "continuous_update"):
            c.continuous_update = False
        if hasattr(getattr(c, "style", None), "description_width"):
            c.style.description_width = "initial"  # the whole label ("global batch"), never cut to "global b..."
        c.observe(on_change, names="value")


def synced(update, figs):
    """`update`, followed by storing each FigureWidget's whole picture in its synced state.

    Why: a FigureWidget nested in a box is never displayed itself, so plotly never runs its
    `_repr_mimebundle_`, the one place that copies the figure into the synced `_widget_data` /
    `_widget_layout` traits; they keep the figure as it was built (empty here). The browser's copy
    otherwise follows only through plotly's `_py2js_*` delta messages, applied by listeners that
    plotly's model code registers once its module has loaded; deltas that arrive earlier are lost
    to them (our `figure_widget.FigureWidget` loads that module in the background, so its model
    accepts messages at once). Synced traits are state, not events: the model keeps their last
    value whenever it arrives, and every view draws from them when it is created."""
    import copy

    import plotly.graph_objects as go

    def run():
        update()
        for fig in figs:
            if isinstance(fig, go.FigureWidget):
                fig._widget_layout = copy.deepcopy(fig._layout_obj._props)
                fig._widget_data = copy.deepcopy(fig._data)
    return run


def _explorer(controls: dict, fig, status, update, per_row: int = 4, also=()):
    """Lay out controls (`per_row` on the first row), status line and figure; wire every control
    to `update` (with the figures' state synced after it, see `synced`; `also`: more figures it
    redraws); run it once. The box carries the CSS class `mini3d-explorer` (the browser test
    finds explorers by it)."""
    update = synced(update, [fig, *also])
    wire(controls, status, update)
    row = list(controls.values())
    box = W.VBox([W.HBox(row[:per_row]), W.HBox(row[per_row:]), status, fig])
    box.add_class("mini3d-explorer")
    box.controls, box.figure, box.status, box.refresh = controls, fig, status, update
    update()
    return box


def _guard(status, fn):
    try:
        out = fn()
    except ValueError as e:
        status.value = f"<span style='color:{CAPACITY_COLOR}'>{e}</span>"
        return None
    return out


# ---------------------------------------------------------------- pipeline schedules


def schedule_view(simulate_fn, kind: str, p: int, m: int, v: int = 1, bwd_ratio: float = 2.0) -> dict:
    """Simulate one step: {'timeline', 'bubble_fraction', 'makespan', 'formula'}."""
    v = chunks_for(kind, v)
    res = simulate_fn(kind, p, m, v, bwd_ratio)
    timeline = _get(res, "timeline")
    makespan = max((float(e) for row in timeline for _, e, _ in row), default=0.0)
    return dict(timeline=timeline, bubble_fraction=float(_get(res, "bubble_fraction")),
                makespan=makespan, formula=bubble_formula_text(kind, p, m, v))


def schedule_explorer(simulate_fn, kind: str = "1f1b", p: int = 4, m: int = 4, v: int = 2,
                      bwd_ratio: float = 2.0):
    """Sliders for p, m, v, the schedule and the backward/forward cost ratio over a live Gantt."""
    controls = dict(
        kind=W.Dropdown(options=list(SCHEDULE_MENU), value=kind, description="schedule"),
        p=W.IntSlider(value=p, min=1, max=8, description="stages p"),
        m=W.IntSlider(value=m, min=1, max=32, description="micro-batches m"),
        v=W.IntSlider(value=v, min=1, max=4, description="chunks v"),
        bwd_ratio=W.FloatSlider(value=bwd_ratio, min=1.0, max=3.0, step=0.5, description="t_bwd/t_fwd"),
    )
    for c in controls.values():
        c.style.description_width = "initial"
    fig = gantt_figure([], 0.0, widget=True)
    status = W.HTML()

    def update():
        vals = {k: c.value for k, c in controls.items()}
        controls["v"].disabled = schedule_kind(vals["kind"]).fixed_chunks is not None  # its own v
        view = _guard(status, lambda: schedule_view(simulate_fn, **vals))
        if view is None:
            return
        fill_gantt(fig, view["timeline"], view["bubble_fraction"], view["formula"])
        status.value = (f"bubble fraction <b>{view['bubble_fraction']:.1%}</b>, step time "
                        f"{view['makespan']:.1f} forward units; closed form {view['formula']}")

    return _explorer(controls, fig, status, update)


# ---------------------------------------------------------------- memory


def memory_view(estimate_fn, capacity_gib: float = 80, **plan) -> dict:
    """{'breakdown', 'total', 'fits'} of one rank under the chosen plan."""
    b = as_breakdown(estimate_fn(**plan))
    total = sum(b.values())
    return dict(breakdown=b, total=total, fits=total <= capacity_gib * GIB)


def _redraw_bars(fig, src):
    """Copy the traces, shapes and annotations of figure `src` into FigureWidget `fig`."""
    with fig.batch_update():
        fig.data = []
        fig.add_traces(list(src.data))
        fig.layout.shapes = src.layout.shapes
        fig.layout.annotations = src.layout.annotations
        fig.layout.barmode = src.layout.barmode
        fig.layout.yaxis.range = src.layout.yaxis.range


def cluster_line(tp: int, pp: int, dp: int, gpus_per_node: int = 8) -> str:
    """'64 GPUs on 8 nodes of 8: tp groups inside a node; pp 8 of 8 groups cross nodes, ...'."""
    from mini3d.grid import Grid

    grid = Grid(tp=tp, pp=pp, dp=dp)
    n = grid.world_size
    nodes = -(-n // gpus_per_node)
    parts = []
    for axis in ("tp", "pp", "dp"):
        if grid.sizes[axis] > 1:
            cross, total = len(grid.crossing_groups(axis, gpus_per_node)), len(grid.groups(axis))
            parts.append(f"{axis}: {cross} of {total} groups cross nodes" if cross else f"{axis} inside a node")
    return (f"{n} GPU{'s' if n > 1 else ''} on {nodes} node{'s' if nodes > 1 else ''} of {gpus_per_node}"
            + (": " + "; ".join(parts) if parts else ""))


def memory_calculator(estimate_fn, models=("gpt-7b", "gpt-22b", "llama-3.1-70b", "gpt-175b"), model="llama-3.1-70b",
                      capacity_gib: float = 80, tp: int = 1, pp: int = 1, dp: int = 8, gpus_per_node: int = 8):
    """Model, tp, pp, dp, ZeRO, micro-batches and recomputation controls over one rank's memory bar;
    the status line gives the GPU count (tp x pp x dp), the nodes and which groups cross them."""
    controls = dict(
        model=W.Dropdown(options=list(dict.fromkeys([*models, model])), value=model, description="model"),
        tp=W.SelectionSlider(options=POW2[:5], value=tp, description="tp"),
        pp=W.SelectionSlider(options=POW2, value=pp, description="pp"),
        dp=W.SelectionSlider(options=POW2, value=dp, description="dp"),
        zero=W.Dropdown(options=[0, 1, 2, 3], value=0, description="ZeRO"),
        micro_batches=W.IntSlider(value=8, min=1, max=64, description="micro-batches"),
        recompute=W.Dropdown(options=["none", "selective", "full"], value="none", description="recompute"),
        dtype=W.Dropdown(options=["bf16", "float32"], value="bf16", description="dtype"),
    )
    fig = memory_breakdown_figure({}, capacity_gib * GIB, widget=True)
    status = W.HTML()

    def update():
        plan = {k: c.value for k, c in controls.items()}
        view = _guard(status, lambda: memory_view(estimate_fn, capacity_gib, **plan))
        if view is None:
            return
        label = f"{plan['model']} tp={plan['tp']} pp={plan['pp']} dp={plan['dp']} ZeRO-{plan['zero']}"
        _redraw_bars(fig, memory_breakdown_figure({label: view["breakdown"]}, capacity_gib * GIB))
        status.value = (f"{to_gib(view['total']):.1f} GiB per GPU: "
                        + ("fits" if view["fits"] else f"<b>does not fit</b> in {capacity_gib:g} GiB")
                        + ". " + cluster_line(plan["tp"], plan["pp"], plan["dp"], gpus_per_node))

    return _explorer(controls, fig, status, update)


def zero_explorer(estimate_fn, models=("gpt-1.3b", "gpt-7b", "gpt-22b"), model="gpt-7b",
                  capacity_gib: float = 80):
    """dp and ZeRO-stage controls over per-rank memory: one stacked bar per dp rank, with the
    no-ZeRO total marked for comparison. `estimate_fn` is called with model, dp and zero."""
    controls = dict(
        model=W.Dropdown(options=list(models), value=model, description="model"),
        dp=W.SelectionSlider(options=POW2[1:], value=8, description="dp"),
        zero=W.IntSlider(value=0, min=0, max=3, description="ZeRO stage"),
    )
    fig = new_figure("Per-rank memory under ZeRO", "data-parallel rank", "memory per rank (GiB)", widget=True)
    status = W.HTML()

    def update():
        model, dp, zero = (controls[k].value for k in ("model", "dp", "zero"))
        view = _guard(status, lambda: memory_view(estimate_fn, capacity_gib, model=model, dp=dp, zero=zero))
        base = _guard(status, lambda: memory_view(estimate_fn, capacity_gib, model=model, dp=dp, zero=0))
        if view is None or base is None:
            return
        # bars named by their dp index alone (short labels stay horizontal up to dp=128)
        src = memory_breakdown_figure({str(r): view["breakdown"] for r in range(dp)},
                                      capacity_gib * GIB, title="")
        total = next(t for t in src.data if t.name == "total")  # equal bars: label the middle one only
        total.text = ["" if r != dp // 2 else t for r, t in enumerate(total.text)]
        src.add_scatter(x=[str(r) for r in range(dp)], y=[to_gib(base["total"])] * dp,
                        mode="markers", marker=dict(symbol="line-ew-open", size=30, color="#222"),
                        name="without ZeRO")
        _redraw_bars(fig, src)
        status.value = (f"ZeRO-{zero} on dp={dp}: {to_gib(view['total']):.1f} GiB per rank "
                        f"(no ZeRO: {to_gib(base['total']):.1f} GiB)")

    return _explorer(controls, fig, status, update)


# ---------------------------------------------------------------- planning


def planner_view(plan_fn, **query) -> dict:
    """{'rows', 'best'}: candidate plans, and the fastest one that fits (None if none fits)."""
    rows = [dict(r) for r in plan_fn(**query)]
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: r["step_time_s"]) if fitting else None
    return dict(rows=rows, best=best)


def planner_explorer(plan_fn, models=("gpt-7b", "gpt-22b", "llama-3.1-70b", "gpt-175b"), model="llama-3.1-70b"):
    """Model, GPU count and GPU memory controls over every candidate (tp, pp, dp): step time vs memory."""
    controls = dict(
        model=W.Dropdown(options=list(models), value=model, description="model"),
        gpus=W.SelectionSlider(options=[8, 16, 32, 64, 128, 256, 512, 1024], value=64, description="GPUs"),
        gpu_mem_gib=W.Dropdown(options=[24, 40, 80, 141], value=80, description="GPU memory (GiB)"),
    )
    fig = new_figure("Candidate plans", "step time (s)", "peak memory per GPU (GiB)", widget=True)
    status = W.HTML()

    def update():
        q = {k: c.value for k, c in controls.items()}
        view = _guard(status, lambda: planner_view(plan_fn, **q))
        if view is None:
            return
        rows = view["rows"]
        with fig.batch_update():
            fig.data = []
            for fits, color in ((True, "#2e9e5b"), (False, "#bbbbbb")):
                sel = [r for r in rows if bool(r["fits"]) == fits]
                fig.add_scatter(x=[r["step_time_s"] for r in sel], y=[to_gib(r["memory_bytes"]) for r in sel],
                                mode="markers", name="fits" if fits else "does not fit",
                                marker=dict(size=10, color=color),
                                text=[f"tp={r['tp']} pp={r['pp']} dp={r['dp']}" for r in sel],
                                hovertemplate="%{text}<br>%{x:.2f} s, %{y:.1f} GiB<extra></extra>")
            best = view["best"]
            fig.layout.shapes = []
            fig.add_shape(type="line", xref="paper", x0=0, x1=1, yref="y", y0=q["gpu_mem_gib"],
                          y1=q["gpu_mem_gib"], line=dict(color=CAPACITY_COLOR, dash="dash"))
            fig.layout.meta = {"best": best}
        status.value = ("no plan fits" if best is None else
                        f"best: tp={best['tp']} pp={best['pp']} dp={best['dp']}, "
                        f"{best['step_time_s']:.2f} s/step, {to_gib(best['memory_bytes']):.1f} GiB/GPU")

    return _explorer(controls, fig, status, update)


__all__ = ["BUSY", "wire", "synced", "cluster_line", "schedule_view", "schedule_explorer", "memory_view", "memory_calculator", "zero_explorer",
           "planner_view", "planner_explorer"]
