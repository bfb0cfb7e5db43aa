"""Chapter 09 (planning a real run): the planner as an explorer, time breakdowns, predicted vs measured.

    planner_fn(...)              mini3d.cost.planner.search wrapped to the explorer's contract
    plan_view(plan_fn, **query)  controls -> plain data (rows per layout, the ranked best, a sentence)
    plan_explorer(plan_fn)       model / cluster / GPU count / global batch over two live figures
    time_breakdown_figure(rows)  where each ranked layout's step time goes (stacked seconds)
    layout_scatter_figure(rows)  one point per (tp, pp, dp): step time vs memory, capacity line
    predicted_vs_measured_figure(rows)  the capstone: the cost model's step time next to a live run

Contract of `plan_fn(model=, hardware=, gpus=, global_batch=)`: a dict with
    rows      one dict per (tp, pp, dp): tp, pp, dp, layout, step_time_s, memory_bytes, fits
              (the fastest fitting plan of that layout, or its smallest-memory plan if none fits)
    ranked    the fastest fitting plans overall (full search), each with layout, step_time_s,
              memory_bytes and breakdown {term: seconds}
    capacity_bytes, explanation (why the best beats the runner-up, or why nothing fits)
"""

from __future__ import annotations

import ipywidgets as W

from mini3d.cost.model import TIME_TERMS
from mini3d.course.viz.theme import CAPACITY_COLOR, new_figure, to_gib
from mini3d.course.viz.widgets import synced, wire

# The step-time terms are the cost model's own list (mini3d.cost.model.TIME_TERMS, in the order
# they are stacked): they add up to its step_time_s, so a layout never draws short.
TERM_LABELS = {"compute": "compute", "tp_comm": "tp all-reduce", "cp_comm": "cp ring (exposed)",
               "ep_comm": "ep all-to-all", "bubble": "pipeline bubble", "pp_comm": "pp send/recv",
               "dp_exposed": "dp sync (exposed)", "optimizer": "optimizer"}
TERM_COLORS = {"compute": "#3b6fb6", "tp_comm": "#2e9e5b", "cp_comm": "#b59a2a", "ep_comm": "#c05fa0",
               "bubble": "#e6a23c", "pp_comm": "#c8553d", "dp_exposed": "#7fa7db", "optimizer": "#8e6bbf"}


def _row(est, layout: str) -> dict:
    p = est.plan
    return dict(tp=p.tp, pp=p.pp, dp=p.dp, layout=layout, step_time_s=float(est.step_time_s),
                memory_bytes=float(est.memory.total), fits=bool(est.fits),
                breakdown={k: float(est.breakdown[k]) for k in TIME_TERMS}, mfu=float(est.mfu))


def ranked_rows(found, top_k: int = 5) -> list[dict]:
    """Rows for `time_breakdown_figure` from a `mini3d.cost.planner.PlanSearch` (its fastest plans)."""
    from mini3d.cost.planner import describe

    return [_row(e, describe(e.plan)) for e in found.candidates[:top_k]]


def planner_fn(seq_len: int | None = None, dtype: str = "bf16", top_k: int = 5):
    """`plan_fn(model=, hardware=, gpus=, global_batch=)` backed by mini3d.cost.planner.search.

    The ranking is the planner's own (every valid layout, schedule, ZeRO stage, recompute policy and
    micro-batch size); the scatter keeps the fastest fitting plan per (tp, pp, dp), or the one with
    the least memory when none of that layout fits."""
    from mini3d.config import model_from_preset
    from mini3d.cost.hardware import load_hardware
    from mini3d.cost.model import estimate_cost
    from mini3d.cost.planner import candidate_plans, describe, search
    from mini3d.cost.memory import estimate_memory

    def fn(model="gpt-7b", hardware="A100-80GB", gpus=8, global_batch=32):
        cfg, hw = model_from_preset(model), load_hardware(hardware)
        s = seq_len or cfg.max_seq_len
        found = search(cfg, gpus, hw, global_batch, s, dtype, top_k=10**9, suggest=False)
        best: dict = {}
        for est in found.candidates:  # fastest first: the first of each layout is its best
            best.setdefault((est.plan.tp, est.plan.pp, est.plan.dp), est)
        smallest: dict = {}
        for plan in candidate_plans(cfg, gpus, global_batch, s, dtype):
            key = (plan.tp, plan.pp, plan.dp)
            if key not in best:
                mem = estimate_memory(cfg, plan).total
                if key not in smallest or mem < smallest[key][0]:
                    smallest[key] = (mem, plan)
        ests = list(best.values()) + [estimate_cost(cfg, p, hw, gpus) for _, p in smallest.values()]
        if not found.candidates and not ests:
            raise ValueError(f"no valid layout of {model} on gpus={gpus} with global_batch="
                             f"{global_batch} (dp must divide the batch, tp the {cfg.n_heads} heads)")
        return dict(rows=[_row(e, describe(e.plan)) for e in ests],
                    ranked=ranked_rows(found, top_k),
                    capacity_bytes=float(hw.memory_bytes), explanation=found.explanation)

    return fn


def plan_view(plan_fn, **query) -> dict:
    """{'rows', 'ranked', 'best', 'capacity_bytes', 'explanation'} for one query."""
    out = dict(plan_fn(**query))
    out["best"] = out["ranked"][0] if out["ranked"] else None
    return out


def layout_scatter_figure(rows, capacity_bytes: float | None = None, widget: bool = False):
    """One marker per (tp, pp, dp): its best step time against its memory per GPU."""
    fig = new_figure("Every layout at its best", "step time (s)", "memory per GPU (GiB)", widget=widget)
    _fill_scatter(fig, rows, capacity_bytes)
    return fig


def _fill_scatter(fig, rows, capacity_bytes):
    """Markers for every layout; only the fastest fitting one is labelled on the plot (labels on
    dozens of nearby points would cover each other), the others name themselves on hover."""
    fig.data = []
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: r["step_time_s"]) if fitting else None
    for fits, color in ((True, "#2e9e5b"), (False, "#bbbbbb")):
        sel = [r for r in rows if bool(r["fits"]) == fits]
        fig.add_scatter(x=[r["step_time_s"] for r in sel], y=[to_gib(r["memory_bytes"]) for r in sel],
                        mode="markers+text", name="fits" if fits else "does not fit",
                        marker=dict(size=10, color=color), textposition="top right",  # the best is leftmost
                        text=[f"best: tp{r['tp']} pp{r['pp']} dp{r['dp']}" if r is best else "" for r in sel],
                        hovertext=[r["layout"] for r in sel],
                        hovertemplate="%{hovertext}<br>%{x:.3f} s, %{y:.1f} GiB<extra></extra>")
    fig.layout.shapes = []
    if capacity_bytes:
        fig.add_shape(type="line", xref="paper", x0=0, x1=1, yref="y", y0=to_gib(capacity_bytes),
                      y1=to_gib(capacity_bytes), line=dict(color=CAPACITY_COLOR, dash="dash"))
    fig.update_xaxes(type="log")


def time_breakdown_figure(rows, title: str = "Where the step time goes (ranked layouts)",
                          widget: bool = False):
    """Horizontal stacked bars, one per layout (fastest on top), seconds per cost-model term."""
    fig = new_figure(title, "step time (s)", "layout", widget=widget)
    _fill_breakdown(fig, rows)
    return fig


def _fill_breakdown(fig, rows):
    labels = [f"{i}. {r['layout']}" for i, r in enumerate(rows, 1)]
    fig.data = []
    for term in TIME_TERMS:
        fig.add_bar(y=labels, x=[r["breakdown"][term] for r in rows], orientation="h",
                    name=TERM_LABELS[term], marker_color=TERM_COLORS[term],
                    hovertemplate="%{y}<br>" + TERM_LABELS[term] + ": %{x:.4f} s<extra></extra>")
    # automargin: the left margin grows to the longest layout name, so the axis title never sits on it
    fig.update_layout(barmode="stack", margin=dict(l=70),
                      yaxis=dict(autorange="reversed", automargin=True, title=dict(text="layout", standoff=12)))


def plan_explorer(plan_fn, models=("gpt-1.3b", "gpt-7b", "gpt-22b", "llama-3.1-70b"), model="gpt-7b",
                  hardware=("A100-40GB", "A100-80GB", "H100-80GB"), gpus: int = 8,
                  global_batch: int = 32):
    """Model, cluster (GPU kind), GPU count and global batch over the layout scatter and the
    time breakdown of the planner's top layouts; the status line says why the best wins."""
    controls = dict(
        model=W.Dropdown(options=list(models), value=model, description="model"),
        hardware=W.Dropdown(options=list(hardware), value=hardware[1] if len(hardware) > 1
                            else hardware[0], description="GPU"),
        gpus=W.SelectionSlider(options=[4, 8, 16, 32, 64], value=gpus, description="GPUs"),
        global_batch=W.SelectionSlider(options=[8, 16, 32, 64, 128], value=global_batch,
                                       description="global batch"),
    )
    scatter = layout_scatter_figure([], widget=True)
    bars = time_breakdown_figure([], widget=True)
    status = W.HTML()

    def update():
        q = {k: c.value for k, c in controls.items()}
        try:
            view = plan_view(plan_fn, **q)
        except ValueError as e:
            status.value = f"<span style='color:{CAPACITY_COLOR}'>{e}</span>"
            return
        with scatter.batch_update():
            _fill_scatter(scatter, view["rows"], view["capacity_bytes"])
        with bars.batch_update():
            _fill_breakdown(bars, view["ranked"])
        scatter.layout.meta = {"best": view["best"]}
        status.value = view["explanation"]

    update = synced(update, [scatter, bars])
    wire(controls, status, update)
    box = W.VBox([W.HBox(list(controls.values())), status, scatter, bars])
    box.add_class("mini3d-explorer")
    box.controls, box.figure, box.figures, box.status, box.refresh = controls, scatter, (scatter, bars), \
        status, update
    update()
    return box


def predicted_vs_measured_figure(rows, title: str = "Predicted vs measured step time"):
    """Grouped bars per layout: the cost model's seconds per step next to the measured median.

    Each row: {'layout', 'predicted_s', 'measured_s'} (measured_s may also carry min/max as
    'measured_min_s' / 'measured_max_s', drawn as an error bar)."""
    fig = new_figure(title, "layout", "step time (s)")
    labels = [r["layout"] for r in rows]
    fig.add_bar(x=labels, y=[r["predicted_s"] for r in rows], name="predicted (cost model)",
                marker_color="#8e6bbf")
    err = None
    if rows and all("measured_min_s" in r and "measured_max_s" in r for r in rows):
        err = dict(type="data", symmetric=False,
                   array=[r["measured_max_s"] - r["measured_s"] for r in rows],
                   arrayminus=[r["measured_s"] - r["measured_min_s"] for r in rows])
    fig.add_bar(x=labels, y=[r["measured_s"] for r in rows], name="measured (median, min-max)",
                marker_color="#e8893a", error_y=err)
    fig.update_layout(barmode="group")
    return fig




def planner_explorer_fn(hardware: str = "A100-80GB", global_batch: int = 32, dtype: str = "bf16"):
    """`plan_fn(model=, gpus=, gpu_mem_gib=)` for `mini3d.course.viz.widgets.planner_explorer`: the same
    search on `hardware` with its memory replaced by the chosen GiB, one row per (tp, pp, dp)."""
    import dataclasses
    import os
    import tempfile

    from mini3d.cost.hardware import load_hardware, save_hardware

    def fn(model="llama-3.1-70b", gpus=64, gpu_mem_gib=80):
        hw = dataclasses.replace(load_hardware(hardware), memory_bytes=gpu_mem_gib * 2**30,
                                 name=f"{hardware}@{gpu_mem_gib}GiB")
        with tempfile.TemporaryDirectory() as d:  # planner_fn loads hardware by name or JSON path
            path = os.path.join(d, "hw.json")
            save_hardware(hw, path)
            view = planner_fn(dtype=dtype)(model=model, hardware=path, gpus=gpus,
                                           global_batch=global_batch)
        return view["rows"]

    return fn



def scaling_rows(model: str = "gpt-175b", hardware: str = "A100-80GB", tp: int = 8, pp: int = 8,
                 global_batch: int = 256, gpus=(64, 128, 256, 512, 1024), **plan) -> list[dict]:
    """Strong scaling of one layout family (tp x pp fixed, dp grows, the global batch fixed) by the
    cost model: {'gpus', 'step_time_s', 'efficiency' (tokens/s per GPU relative to the first
    count), 'bubble_fraction', 'dp_exposed_s'} per GPU count."""
    from mini3d.config import Plan, model_from_preset
    from mini3d.cost.hardware import load_hardware
    from mini3d.cost.model import estimate_cost

    cfg, hw = model_from_preset(model), load_hardware(hardware)
    opts = dict(zero=1, dtype="bf16", recompute="selective", sequence_parallel=tp > 1, seq_len=cfg.max_seq_len)
    opts.update(plan)
    rows, base = [], None
    for n in gpus:
        dp = n // (tp * pp)
        p = Plan(tp=tp, pp=pp, dp=dp, micro_batches=global_batch // dp, global_batch=global_batch, **opts)
        e = estimate_cost(cfg, p, hw, n)
        per_gpu = e.tokens_per_s / n
        base = base or per_gpu
        rows.append(dict(gpus=n, step_time_s=e.step_time_s, efficiency=per_gpu / base,
                         bubble_fraction=e.bubble_fraction, dp_exposed_s=e.breakdown["dp_exposed"]))
    return rows


__all__ = ["ranked_rows", "planner_fn", "planner_explorer_fn", "plan_view", "plan_explorer", "layout_scatter_figure",
           "time_breakdown_figure", "predicted_vs_measured_figure", "scaling_rows", "TIME_TERMS"]
