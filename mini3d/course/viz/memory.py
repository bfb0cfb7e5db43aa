"""Memory figures: where the bytes of one rank go, and what ZeRO and recomputation do to them.

All functions take plain data: a breakdown is a dict {category: bytes} (or any object with the
category attributes, such as the estimator's `MemoryEstimate`), with categories params, grads,
optimizer, activations and comm_buffers. Sizes are plotted in GiB.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

from mini3d.course.viz.theme import (CAPACITY_COLOR, CATEGORIES, CATEGORY_COLORS, CATEGORY_LABELS,
                                     as_breakdown, human_bytes, new_figure, to_gib)


def _capacity_line(fig: go.Figure, capacity_bytes: float | None, label: str = "GPU capacity"):
    """The dashed capacity line, named in the legend (an annotation on the plot would collide with
    the bar totals written above the bars)."""
    if capacity_bytes:
        line = dict(color=CAPACITY_COLOR, dash="dash", width=2)
        fig.add_hline(y=to_gib(capacity_bytes), line=line)
        fig.add_scatter(x=[None], y=[None], mode="lines", line=line, hoverinfo="skip",
                        name=f"{label} {to_gib(capacity_bytes):.0f} GiB")


def _headroom(fig: go.Figure, tops_gib, capacity_bytes: float | None):
    """y range from 0 to 15% above the tallest bar or the capacity line, so the totals written
    above the bars stay inside the plot."""
    top = max(list(tops_gib) + [to_gib(capacity_bytes or 0)], default=0.0)
    if top > 0:
        fig.update_yaxes(range=[0, 1.15 * top])


def _stacked_bars(fig: go.Figure, labels: Sequence[str], breakdowns: Sequence[dict]):
    for c in CATEGORIES:
        ys = [to_gib(b[c]) for b in breakdowns]
        fig.add_bar(x=list(labels), y=ys, name=CATEGORY_LABELS[c], marker_color=CATEGORY_COLORS[c],
                    hovertext=[human_bytes(b[c]) for b in breakdowns],
                    hovertemplate="%{x}<br>" + CATEGORY_LABELS[c] + ": %{hovertext}<extra></extra>")
    fig.update_layout(barmode="stack")


def memory_breakdown_figure(breakdowns: Mapping[str, object], capacity_bytes: float | None = None,
                            title: str = "Memory per GPU by category", widget: bool = False) -> go.Figure:
    """Stacked bars, one per labelled configuration (e.g. 'tp=8'), against a capacity line.

    `breakdowns` maps a bar label to a breakdown ({category: bytes} or a MemoryEstimate). Totals are
    written above the bars; bars that exceed `capacity_bytes` are labelled 'OOM'."""
    labels = list(breakdowns)
    rows = [as_breakdown(breakdowns[k]) for k in labels]
    fig = new_figure(title, "configuration", "memory per GPU (GiB)", widget=widget)
    _stacked_bars(fig, labels, rows)
    totals = [sum(r.values()) for r in rows]
    over = [bool(capacity_bytes) and t > capacity_bytes for t in totals]
    fig.add_scatter(x=labels, y=[to_gib(t) for t in totals], mode="text", showlegend=False,
                    text=[f"{to_gib(t):.1f} GiB" + (" OOM" if o else "") for t, o in zip(totals, over)],
                    textposition="top center", hoverinfo="skip", name="total")
    _capacity_line(fig, capacity_bytes)
    _headroom(fig, [to_gib(t) for t in totals], capacity_bytes)
    return fig


def zero_memory_figure(by_stage: Mapping[int, object], capacity_bytes: float | None = None,
                       dp: int | None = None, widget: bool = False) -> go.Figure:
    """Per-rank memory for ZeRO stages 0-3: `by_stage` maps a ZeRO stage to one rank's breakdown."""
    stages = sorted(by_stage)
    rows = [as_breakdown(by_stage[s]) for s in stages]
    title = "Per-rank memory by ZeRO stage" + (f" (dp={dp})" if dp else "")
    fig = new_figure(title, "ZeRO stage", "memory per rank (GiB)", widget=widget)
    labels = [f"ZeRO-{s}" if s else "no ZeRO" for s in stages]
    _stacked_bars(fig, labels, rows)
    _capacity_line(fig, capacity_bytes)
    _headroom(fig, [to_gib(sum(r.values())) for r in rows], capacity_bytes)
    return fig


def recompute_figure(rows: Sequence[Mapping], title: str = "Activation recomputation: memory for compute",
                     widget: bool = False) -> go.Figure:
    """Memory vs compute per recompute policy.

    Each row: {'policy': 'none'|'selective'|'full', 'activation_bytes': peak activation bytes,
    'compute_factor': step compute relative to no recomputation (e.g. 1.33 for full recompute)}.
    Points closer to the origin are better; the trade-off is the curve joining them."""
    fig = new_figure(title, "compute per step (x no-recompute)", "activation memory per GPU (GiB)",
                     widget=widget)
    fig.add_scatter(x=[float(r["compute_factor"]) for r in rows],
                    y=[to_gib(r["activation_bytes"]) for r in rows],
                    mode="lines+markers+text", text=[str(r["policy"]) for r in rows],
                    textposition="top right", marker=dict(size=12, color=CATEGORY_COLORS["activations"]),
                    line=dict(dash="dot", color="#aaa"), name="policy",
                    hovertemplate="%{text}: %{y:.2f} GiB at %{x:.2f}x compute<extra></extra>")
    return fig


__all__ = ["memory_breakdown_figure", "zero_memory_figure", "recompute_figure"]
