"""The rank grid as a 3D cube: one point per rank at (tp, pp, dp), coloured by group, nodes boxed.

Input is plain data: a list of {'rank', 'tp', 'pp', 'dp'} dicts, or anything with `world_size` and
`coords(rank)` (such as `mini3d.grid.Grid`), which `rank_points` turns into that list.
"""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go

from mini3d.course.viz.theme import AXIS_COLORS, TEMPLATE_NAME

_PALETTE = ["#3b6fb6", "#e8893a", "#2e9e5b", "#c8553d", "#8e6bbf", "#b59a2a", "#17becf", "#7f7f7f",
            "#e377c2", "#8c564b", "#bcbd22", "#1f77b4"]
_AXES = ("tp", "pp", "dp")


def rank_points(grid_or_points) -> list[dict]:
    """[{'rank', 'tp', 'pp', 'dp'}, ...] from a Grid-like object or an existing list of dicts."""
    if hasattr(grid_or_points, "coords") and hasattr(grid_or_points, "world_size"):
        g = grid_or_points
        return [dict(rank=r, **g.coords(r)) for r in range(g.world_size)]
    return [dict(p) for p in grid_or_points]


def group_key(point: dict, axis: str) -> tuple:
    """Ranks share an `axis` group when their other two coordinates agree."""
    return tuple(point[a] for a in _AXES if a != axis)


def _box_edges(lo: Sequence[float], hi: Sequence[float]):
    """x, y, z lists (None-separated) tracing the 12 edges of an axis-aligned box."""
    xs, ys, zs = [], [], []
    corners = [(x, y, z) for x in (lo[0], hi[0]) for y in (lo[1], hi[1]) for z in (lo[2], hi[2])]
    for i, a in enumerate(corners):
        for b in corners[i + 1:]:
            if sum(u != v for u, v in zip(a, b)) == 1:
                for c, acc in zip(zip(a, b), (xs, ys, zs)):
                    acc += [c[0], c[1], None]
    return xs, ys, zs


def rank_cube_figure(grid_or_points, color_by: str = "tp", gpus_per_node: int | None = None,
                     title: str | None = None) -> go.Figure:
    """Points at (tp, pp, dp) coordinates; one trace per `color_by` group (members joined by a line);
    when `gpus_per_node` is given, a dashed box around each node's ranks (node = rank // gpus_per_node)."""
    if color_by not in _AXES:
        raise ValueError(f"color_by={color_by!r} must be one of {_AXES}")
    pts = rank_points(grid_or_points)
    groups: dict[tuple, list[dict]] = {}
    for p in pts:
        groups.setdefault(group_key(p, color_by), []).append(p)
    fig = go.Figure()
    for i, (key, members) in enumerate(sorted(groups.items())):
        members = sorted(members, key=lambda p: p[color_by])
        fig.add_scatter3d(x=[p["tp"] for p in members], y=[p["pp"] for p in members],
                          z=[p["dp"] for p in members], mode="markers+lines+text",
                          text=[str(p["rank"]) for p in members], name=f"{color_by} group {i}",
                          marker=dict(size=9, color=_PALETTE[i % len(_PALETTE)]),
                          line=dict(color=_PALETTE[i % len(_PALETTE)], width=4),
                          hovertemplate="rank %{text}: tp=%{x} pp=%{y} dp=%{z}<extra></extra>")
    if gpus_per_node:
        nodes: dict[int, list[dict]] = {}
        for p in pts:
            nodes.setdefault(p["rank"] // gpus_per_node, []).append(p)
        for n, members in sorted(nodes.items()):
            lo = [min(p[a] for p in members) - 0.3 for a in _AXES]
            hi = [max(p[a] for p in members) + 0.3 for a in _AXES]
            xs, ys, zs = _box_edges(lo, hi)
            fig.add_scatter3d(x=xs, y=ys, z=zs, mode="lines", name=f"node {n}", hoverinfo="skip",
                              line=dict(color="#555", width=2, dash="dash"))
    fig.update_layout(
        template=TEMPLATE_NAME,
        title=title or f"Rank grid: {len(pts)} ranks, coloured by {color_by} group",
        scene=dict(xaxis_title="tp coordinate (rank index)", yaxis_title="pp coordinate (stage)",
                   zaxis_title="dp coordinate (replica)",
                   xaxis=dict(dtick=1), yaxis=dict(dtick=1), zaxis=dict(dtick=1),
                   # the camera back from the cube and the scene a cube: every corner and axis title
                   # stays inside the scene at a notebook cell's width (plotly's default eye clipped it)
                   aspectmode="cube", camera=dict(eye=dict(x=1.9, y=1.9, z=1.3))),
        legend=dict(itemsizing="constant", x=1.0, xanchor="right", y=1.0),
        margin=dict(l=10, r=10, t=60, b=10), height=560, autosize=True)
    fig.layout.meta = {"color_by": color_by, "axis_color": AXIS_COLORS[color_by]}
    return fig


__all__ = ["rank_cube_figure", "rank_points", "group_key"]
