"""Pipeline figures: a Gantt chart of a (simulated or measured) step, with the bubble annotated.

A timeline is plain data, one list per pipeline rank of `(start, end, action)`, which is exactly what
`mini3d.pp.simulator.simulate(...).timeline` holds. An action may be an object with `op`, `stage`
and `mb` attributes (`mini3d.pp.schedules.Action`), a dict with those keys, or its printed form
("F1.0" = forward of stage 1 on micro-batch 0). Transfers, if present, are drawn as thin grey bars.
In a split schedule (zb-h1, zbv) B is the input-gradient pass and W the weight-gradient pass, drawn
in its own colour: the Gantt then shows W filling what would otherwise be bubble.
"""

from __future__ import annotations

import re
from typing import Sequence

import plotly.graph_objects as go

from mini3d.pp.schedules import bubble_text
from mini3d.pp.simulator import bubble_of, idle_gaps as sim_idle_gaps
from mini3d.schedule_kinds import SCHEDULES, schedule_kind

from mini3d.course.viz.theme import ACTION_COLORS, LEGEND_RIGHT, fit_height, new_figure

GANTT_TOP = 100  # the top margin: the title's band, then the bubble annotation's

_PRINTED = re.compile(r"^([A-Za-z_]+?)(\d+)\.(\d+)")
_SHORT_OPS = {"sF": "SEND_F", "rF": "RECV_F", "sB": "SEND_B", "rB": "RECV_B"}
COMPUTE_OPS = ("F", "B", "W")  # what counts as work; everything else is a transfer or idle


def parse_action(a) -> tuple[str, int, int]:
    """(op, stage, micro-batch) of an Action, a dict or a printed action such as 'B2.3'."""
    if isinstance(a, str):
        match = _PRINTED.match(a)
        if not match:
            raise ValueError(f"action {a!r} is not of the form F<stage>.<micro-batch>")
        op = _SHORT_OPS.get(match.group(1), match.group(1))
        return op, int(match.group(2)), int(match.group(3))
    if isinstance(a, dict):
        return str(a["op"]), int(a["stage"]), int(a["mb"])
    return str(a.op), int(a.stage), int(a.mb)


def _compute_intervals(timeline: Sequence[Sequence]) -> list[list[tuple[float, float]]]:
    return [[(float(s), float(e)) for s, e, a in row if parse_action(a)[0] in COMPUTE_OPS]
            for row in timeline]


def _makespan(timeline: Sequence[Sequence]) -> float:
    return max((float(e) for row in timeline for _, e, _ in row), default=0.0)


def idle_gaps(timeline: Sequence[Sequence]) -> list[list[tuple[float, float]]]:
    """Per rank, the (start, end) intervals with no compute between 0 and the makespan (transfers
    count as idle): `mini3d.pp.simulator.idle_gaps` of the timeline's compute bars."""
    return sim_idle_gaps(_compute_intervals(timeline), _makespan(timeline), eps=1e-12)


def bubble_from_timeline(timeline: Sequence[Sequence]) -> float:
    """Idle share of p * makespan: `mini3d.pp.simulator.bubble_of`, what the simulator reports as
    `bubble_fraction`, here on any timeline (a measured one included)."""
    return float(bubble_of(_compute_intervals(timeline), _makespan(timeline), eps=1e-12))


SCHEDULE_MENU = SCHEDULES  # the registry's kinds, in its order


def chunks_for(kind: str, v: int) -> int:
    """The chunks per rank the explorer uses for `kind`: the slider's v where the schedule takes
    any (interleaved, looped BFS), its own otherwise (2 for zbv's V, else 1): the registry's
    `ScheduleKind.chunks`."""
    return schedule_kind(kind).chunks(v)


def bubble_formula_text(kind: str, p: int, m: int, v: int = 1) -> str:
    """The closed form the chapter teaches, evaluated: '(p-1)/(m+p-1) = 3/11 = 27.3%'
    (`mini3d.pp.schedules.bubble_text`, the kind's `form` at t_F = 1, t_bwd = 2; ZB-H1's with
    t_F = t_B = t_W); ZB-V has none: its simulated bubble."""
    return bubble_text(kind, p, m, v)


def gantt_figure(timeline: Sequence[Sequence], bubble_fraction: float | None = None,
                 formula: str | None = None, title: str = "Pipeline schedule",
                 time_unit: str = "units of one forward", widget: bool = False) -> go.Figure:
    """One horizontal bar per action (forward blue, backward orange, weight-gradient W green) per
    pipeline rank, idle gaps in light grey, and the bubble fraction annotated (computed from the
    timeline when not given).

    Traces: 'forward', 'backward', 'weight' (split schedules only), 'transfer' and 'idle'."""
    fig = new_figure(title, f"time ({time_unit})", "pipeline rank", widget=widget)
    fill_gantt(fig, timeline, bubble_fraction, formula)
    fig.update_yaxes(autorange="reversed", type="category")
    # The title at the very top, the bubble annotation in the band under it, the legend right of
    # the plot (theme.LEGEND_RIGHT): a horizontal legend above the plot wrapped upwards over both in
    # a narrow cell (an interleaved schedule's chunk shades make many entries).
    fig.update_layout(barmode="overlay", bargap=0.15, margin=dict(t=GANTT_TOP), title=dict(y=0.98, yanchor="top"),
                      legend=LEGEND_RIGHT)
    return fig


# Chunk c of an interleaved schedule (stages c*p .. c*p + p-1) in its own shade, darkest first.
CHUNK_SHADES = {"forward": ["#3b6fb6", "#8fb3e3", "#1f3d66", "#c5d8f2"],
                "backward": ["#e8893a", "#f5c18f", "#9c4f12", "#fbe0c4"],
                "weight": ["#5a9e5f", "#a8d5ab", "#2e5e32", "#d4ecd5"]}  # W of split schedules


def _trace_name(kind: str, chunk: int) -> str:
    return kind if chunk == 0 else f"{kind} chunk {chunk}"


def trace_colors() -> dict[str, str]:
    """Colour of every Gantt trace name: forward / backward / weight (and their chunks), transfer,
    idle."""
    colors = {"transfer": "#9a9a9a", "idle": ACTION_COLORS["idle"]}
    for kind, shades in CHUNK_SHADES.items():
        colors.update({_trace_name(kind, c): shade for c, shade in enumerate(shades)})
    return colors


def gantt_traces(timeline: Sequence[Sequence]) -> dict[str, dict]:
    """Bar data per trace name: {'forward': {x, base, y, text}, 'backward': ..., 'idle': ...}."""
    p = max(len(timeline), 1)
    out = {k: dict(x=[], base=[], y=[], text=[]) for k in ("forward", "backward", "transfer", "idle")}
    for r, row in enumerate(timeline):
        for s, e, a in row:
            op, stage, mb = parse_action(a)
            key = {"F": "forward", "B": "backward", "W": "weight"}.get(op, "transfer")
            if key != "transfer":
                key = _trace_name(key, stage // p)  # interleaving: rank r holds stages r, r+p, ...
            d = out.setdefault(key, dict(x=[], base=[], y=[], text=[]))
            d["x"].append(float(e) - float(s))
            d["base"].append(float(s))
            d["y"].append(f"rank {r}")
            d["text"].append(f"{op}{stage}.{mb}" if key == "transfer" else str(mb))
    out = dict(sorted(out.items(), key=lambda kv: kv[0] in ("transfer", "idle")))  # compute first
    for r, gaps in enumerate(idle_gaps(timeline)):
        for s, e in gaps:
            d = out["idle"]
            d["x"].append(e - s)
            d["base"].append(s)
            d["y"].append(f"rank {r}")
            d["text"].append("")
    return out


def fill_gantt(fig: go.Figure, timeline, bubble_fraction=None, formula=None):
    """(Re)draw the Gantt traces and the bubble annotation into `fig` (a Figure or FigureWidget)."""
    if bubble_fraction is None:
        bubble_fraction = bubble_from_timeline(timeline)
    traces = gantt_traces(timeline)
    colors = trace_colors()
    with fig.batch_update() if isinstance(fig, go.FigureWidget) else _nullctx():
        fig.data = []
        for name, d in traces.items():
            if not d["x"] and name in ("transfer", "weight"):
                continue
            fig.add_bar(orientation="h", name=name, x=d["x"], base=d["base"], y=d["y"], text=d["text"],
                        textposition="inside", insidetextanchor="middle",
                        marker=dict(color=colors.get(name, "#555"), line=dict(color="white", width=1)),
                        width=0.3 if name == "transfer" else 0.8,
                        hovertemplate=name + " mb %{text}: %{base:.2f} + %{x:.2f}<extra></extra>")
        label = f"bubble = {float(bubble_fraction):.1%}"
        if formula:
            label += f"   (formula {formula})"
        fig.layout.annotations = []
        fig.add_annotation(text=label, xref="paper", yref="paper", x=1, y=1, yshift=34, showarrow=False,
                           xanchor="right", yanchor="bottom", font=dict(size=14, color="#c0392b"),
                           name="bubble")
        fig.layout.height = fit_height(1, 50 * len(timeline), top=GANTT_TOP)
        fig.layout.meta = {"bubble_fraction": float(bubble_fraction)}


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


__all__ = ["gantt_figure", "gantt_traces", "trace_colors", "CHUNK_SHADES", "fill_gantt", "idle_gaps",
           "bubble_from_timeline", "bubble_formula_text", "parse_action",
           "chunks_for", "SCHEDULE_MENU", "COMPUTE_OPS"]
