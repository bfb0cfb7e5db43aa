"""The rank grid flattened to 2D, beside the 3D cube: pipeline stages as rows, dp replicas side by
side, the tp ranks of a replica next to each other; one square per rank, labelled with its number,
filled by its group on the chosen axis, outlined by its node (alternating dark and light), so
which groups share a machine reads at a glance without rotating anything."""

from __future__ import annotations

from mini3d.course.viz.grid3d import _PALETTE, group_key, rank_points
from mini3d.course.viz.theme import fit_height, new_figure

NODE_OUTLINES = ("#222222", "#bbbbbb")  # even / odd node


def rank_grid_2d_figure(grid, color_by: str = "tp", gpus_per_node: int = 8, widget: bool = False):
    """Squares at (column dp * tp + tp_rank, row pp_rank); `layout.meta['cells']` lists
    (rank, column, row, node) for tests."""
    pts = rank_points(grid)
    tp = max(p["tp"] for p in pts) + 1
    groups = sorted({group_key(p, color_by) for p in pts})
    fig = new_figure(f"Ranks by stage and replica (fill: {color_by} group)", "dp replica x tp rank (column)",
                     "pipeline stage (row)", widget=widget)
    cells = [(p["rank"], p["dp"] * tp + p["tp"], p["pp"], p["rank"] // gpus_per_node) for p in pts]
    fig.add_scatter(
        x=[c for _, c, _, _ in cells], y=[r for _, _, r, _ in cells], mode="markers+text",
        text=[str(rank) for rank, *_ in cells], textfont=dict(color="white", size=12),
        marker=dict(symbol="square", size=30,
                    color=[_PALETTE[groups.index(group_key(p, color_by)) % len(_PALETTE)] for p in pts],
                    line=dict(width=4, color=[NODE_OUTLINES[n % 2] for *_, n in cells])),
        hovertext=[f"rank {rank}: node {n}, tp={p['tp']} pp={p['pp']} dp={p['dp']}"
                   for (rank, _, _, n), p in zip(cells, pts)],
        hoverinfo="text", showlegend=False)
    fig.update_xaxes(tickvals=sorted({c for _, c, _, _ in cells}), range=[-0.7, max(c for _, c, _, _ in cells) + 0.7],
                     showgrid=False)
    fig.update_yaxes(tickvals=sorted({r for _, _, r, _ in cells}), autorange="reversed", showgrid=False)
    fig.update_layout(width=440, height=fit_height(1, 60 * (max(r for _, _, r, _ in cells) + 1)),
                      meta={"cells": cells})
    return fig


__all__ = ["rank_grid_2d_figure", "NODE_OUTLINES"]
