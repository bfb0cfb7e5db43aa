"""Chapter 05 (pipeline parallelism): a live run's measured timeline next to the simulated one.

`train_worker(..., collect=["timeline"])` returns, on every rank of a pp > 1 run, the last step's
actions as [(start, end, action string)] in seconds of the timeline clock (`mini3d.timeline_clock`):
`time.perf_counter` on CPU (one clock for all local processes); on CUDA the GPU's times from timing
events, on the host's seconds scale (not the launch times). These helpers turn that into the
Gantt's per-pipeline-rank timeline (ms from the first action), measure the mean cost of each
stage's forward and backward, and simulate the same schedule with those costs, so the two
pictures can be compared bar by bar.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from mini3d.course.viz.pipeline import (COMPUTE_OPS, bubble_from_timeline, gantt_traces, parse_action,
                                        trace_colors)
from mini3d.course.viz.theme import TEMPLATE_NAME


def measured_timeline(results: Sequence[dict], compute_only: bool = False) -> list[list[tuple]]:
    """Per pipeline rank (tp_rank 0, dp_rank 0 only), [(start_ms, end_ms, action)] from the first
    action of the step. `results` are `launch(train_worker, ...)`'s per-rank dicts."""
    rows = {}
    for r in results:
        c = r.get("coords", {})
        if c.get("tp", 0) == 0 and c.get("dp", 0) == 0 and r.get("timeline"):
            rows[c.get("pp", 0)] = r["timeline"]
    if not rows:
        raise ValueError("no timeline in the results: run with pp > 1 and collect=['timeline']")
    t0 = min(s for row in rows.values() for s, _, _ in row)
    out = []
    for p in sorted(rows):
        keep = [(s, e, a) for s, e, a in rows[p]
                if not compute_only or parse_action(a)[0] in COMPUTE_OPS]
        out.append([(1e3 * (s - t0), 1e3 * (e - t0), a) for s, e, a in keep])
    return out


def stage_costs(timeline: Sequence[Sequence], n_stages: int | None = None) -> tuple[list, list]:
    """Mean duration of the forwards and of the whole backwards of each stage: (t_fwd, t_bwd)
    lists indexed by stage, in the timeline's unit (a split schedule's B + W; `weight_costs` gives
    the W part)."""
    acc = _durations(timeline)
    n = n_stages or 1 + max(stage for _, stage in acc)
    mean = lambda k: sum(acc[k]) / len(acc[k]) if acc[k] else 0.0  # noqa: E731
    return ([mean(("F", s)) for s in range(n)],
            [mean(("B", s)) + mean(("W", s)) for s in range(n)])


def weight_costs(timeline: Sequence[Sequence], n_stages: int) -> list | None:
    """Mean duration of each stage's W (weight gradients), or None when the timeline has no W."""
    acc = _durations(timeline)
    if not any(op == "W" for op, _ in acc):
        return None
    return [sum(acc[("W", s)]) / len(acc[("W", s)]) if acc[("W", s)] else 0.0
            for s in range(n_stages)]


def _durations(timeline) -> dict:
    acc = defaultdict(list)
    for row in timeline:
        for s, e, a in row:
            op, stage, _ = parse_action(a)
            if op in COMPUTE_OPS:
                acc[(op, stage)].append(float(e) - float(s))
    return acc


def measured_vs_simulated(results: Sequence[dict], kind: str, p: int, m: int, v: int = 1) -> dict:
    """{'measured', 'simulated' (timelines in ms), 'measured_bubble', 'simulated_bubble',
    't_fwd', 't_bwd' (ms per stage; t_bwd is B + W for a split schedule), 't_w' (W ms per stage,
    or None), 'measured_makespan', 'simulated_makespan'}.

    The simulation times the same `make_schedule(kind, p, m, v)` with the measured per-stage costs
    and no transfer time; the measured bubble counts every non-compute moment (waiting on a receive,
    sending, Python overhead) as idle, so it is at least the simulated one."""
    from mini3d.pp import make_schedule, simulate

    measured = measured_timeline(results)
    t_fwd, t_bwd = stage_costs(measured, p * v)
    t_w = weight_costs(measured, p * v)
    sim = simulate(make_schedule(kind, p, m, v), t_fwd, t_bwd, t_w=t_w)
    simulated = [[(float(s), float(e), str(a)) for s, e, a in row] for row in sim.timeline]
    span = lambda tl: max(e for row in tl for _, e, _ in row)  # noqa: E731
    return dict(measured=measured, simulated=simulated, measured_bubble=bubble_from_timeline(measured),
                simulated_bubble=float(sim.bubble_fraction), t_fwd=t_fwd, t_bwd=t_bwd, t_w=t_w,
                measured_makespan=span(measured), simulated_makespan=span(simulated))


def gantt_panels(panels: dict, time_unit: str = "units of one forward", title: str = "",
                 shared_x: bool = True):
    """Several Gantt charts stacked in one figure, one panel per entry of `panels`
    {panel title: timeline}, with the same trace colours as `gantt_figure` and each panel's bubble
    fraction (from its timeline) in its title. meta['bubbles'] maps panel title -> fraction."""
    from plotly.subplots import make_subplots

    names = list(panels)
    bubbles = {n: bubble_from_timeline(panels[n]) for n in names}
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=shared_x, vertical_spacing=0.1,
                        subplot_titles=[f"{n}: bubble {bubbles[n]:.1%}" for n in names])
    colors, shown = trace_colors(), set()
    for i, n in enumerate(names, start=1):
        for name, d in gantt_traces(panels[n]).items():
            if not d["x"] and name in ("transfer", "weight"):
                continue
            fig.add_bar(orientation="h", name=name, x=d["x"], base=d["base"], y=d["y"], text=d["text"],
                        textposition="inside", insidetextanchor="middle", legendgroup=name,
                        showlegend=name not in shown, width=0.3 if name == "transfer" else 0.8,
                        marker=dict(color=colors.get(name, "#555"), line=dict(color="white", width=1)),
                        hovertemplate=name + " mb %{text}: %{base:.2f} + %{x:.2f}<extra></extra>",
                        row=i, col=1)
            shown.add(name)
        fig.update_yaxes(title_text="pipeline rank", autorange="reversed", type="category", row=i, col=1)
    fig.update_xaxes(title_text=f"time ({time_unit})", row=len(names), col=1)
    if not shared_x:
        for i in range(1, len(names)):
            fig.update_xaxes(title_text=f"time ({time_unit})", row=i, col=1)
    rows = sum(len(panels[n]) for n in names)
    fig.update_layout(template=TEMPLATE_NAME, title=title, barmode="overlay", bargap=0.15,
                      height=140 + 45 * rows + 60 * len(names))  # legend at the right: clear of the panel titles
    fig.layout.meta = {"bubbles": bubbles}
    return fig


__all__ = ["measured_timeline", "stage_costs", "weight_costs", "measured_vs_simulated",
           "gantt_panels"]
