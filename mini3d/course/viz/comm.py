"""Communication figures: bytes per axis, ring all-reduce cost, and the scaling 'communication tax'."""

from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

from mini3d.course.viz.theme import AXIS_COLORS, human_bytes, new_figure

MIB = 1024 ** 2


def comm_volume_figure(bytes_per_axis: Mapping[str, object], title: str = "Communication volume per axis",
                       widget: bool = False) -> go.Figure:
    """Bars of bytes sent per axis. Values are bytes, or {op: bytes} dicts (stacked by op), as in
    the per-axis counters of `mini3d.comm`."""
    axes = list(bytes_per_axis)
    fig = new_figure(title, "rank-grid axis", "bytes per step (MiB)", widget=widget)
    by_op: dict[str, list[float]] = {}
    for i, axis in enumerate(axes):
        v = bytes_per_axis[axis]
        items = v.items() if isinstance(v, Mapping) else [("total", v)]
        for op, b in items:
            by_op.setdefault(op, [0.0] * len(axes))[i] += float(b)
    for op, vals in by_op.items():
        fig.add_bar(x=axes, y=[b / MIB for b in vals], name=op,
                    marker_color=None if len(by_op) > 1 else [AXIS_COLORS.get(a, "#888") for a in axes],
                    hovertext=[human_bytes(b) for b in vals],
                    hovertemplate="%{x} " + op + ": %{hovertext}<extra></extra>")
    fig.update_layout(barmode="stack", showlegend=len(by_op) > 1)
    return fig


def _ring_seconds(n: int, nbytes: float, bandwidth_gbps: float, latency_s: float) -> float:
    """One flat ring all-reduce, timed by the cost model's owner `Hardware.collective_s`."""
    import dataclasses

    from mini3d.cost.hardware import PRESETS

    hw = dataclasses.replace(PRESETS["A100-80GB"], latency_s=latency_s)
    return hw.collective_s("all_reduce", n, float(nbytes), bandwidth_gbps * 1e9)


def ring_allreduce_figure(nbytes: float, ranks: Sequence[int], bandwidths_gbps: Mapping[str, float],
                          latency_s: float = 0.0, time_fn=_ring_seconds) -> go.Figure:
    """All-reduce time vs ranks, one line per named link (e.g. {'NVLink': 300, 'InfiniBand': 25}):
    `time_fn(n, nbytes, GB/s, latency_s)`, by default a flat ring (`Hardware.collective_s`)."""
    fig = new_figure(f"Ring all-reduce of {human_bytes(nbytes)}", "ranks in the ring (GPUs)",
                     "all-reduce time (ms)")
    for name, bw in bandwidths_gbps.items():
        fig.add_scatter(x=list(ranks), y=[1e3 * time_fn(n, nbytes, bw, latency_s) for n in ranks],
                        mode="lines+markers", name=f"{name} ({bw:g} GB/s)")
    fig.update_xaxes(type="log", tickvals=list(ranks))
    return fig


def scaling_efficiency_figure(gpus: Sequence[int], efficiency: Sequence[float],
                              title: str = "Scaling: what N GPUs are really worth") -> go.Figure:
    """Effective GPUs (N x efficiency) against the ideal line, with the last point annotated
    ('1024 GPUs work like 512')."""
    fig = new_figure(title, "GPUs (count)", "effective GPUs (count of ideal GPUs)")
    gpus, eff = [int(g) for g in gpus], [float(e) for e in efficiency]
    fig.add_scatter(x=gpus, y=gpus, mode="lines", name="ideal (linear)", line=dict(dash="dash", color="#888"))
    effective = [g * e for g, e in zip(gpus, eff)]
    fig.add_scatter(x=gpus, y=effective, mode="lines+markers", name="achieved",
                    customdata=eff, hovertemplate="%{x} GPUs work like %{y:.0f} (%{customdata:.0%})<extra></extra>")
    if gpus:
        fig.add_annotation(x=gpus[-1], y=effective[-1], text=f"{gpus[-1]} GPUs work like {effective[-1]:.0f}",
                           showarrow=True, arrowhead=2, ax=-80, ay=-40, name="tax")
    fig.update_xaxes(type="log", tickvals=gpus)
    fig.update_yaxes(type="log", tickvals=gpus)
    return fig


__all__ = ["comm_volume_figure", "ring_allreduce_figure", "scaling_efficiency_figure"]
