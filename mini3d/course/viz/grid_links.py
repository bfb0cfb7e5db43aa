"""Chapter 06 (3D parallelism): which group talks over which link, and a rank-grid explorer.

`link_table(grid, gpus_per_node)` reads every tp / pp / dp group off a `mini3d.grid.Grid` and says
whether it stays inside one node (NVLink) or crosses nodes (InfiniBand), with what each axis sends
and how often. `rank_grid_explorer()` puts tp, pp, dp, the colouring axis and the node size on
controls over `rank_cube_figure`, with `Grid.describe` in the status line.
"""

from __future__ import annotations

import html

import ipywidgets as W

from mini3d.course.viz.figure_widget import FigureWidget
from mini3d.course.viz.grid2d import rank_grid_2d_figure
from mini3d.course.viz.grid3d import rank_cube_figure

# What each axis communicates (the chapter's comparison table, in one place).
TRAFFIC = {
    "tp": "all-reduce of activations, 2 per layer forward + 2 backward",
    "pp": "point-to-point activations / gradients at stage boundaries, per micro-batch",
    "dp": "all-reduce (or ZeRO reduce-scatter + all-gather) of gradients, once per step (ZeRO-2/3: per micro-batch)",
}


def link_table(grid, gpus_per_node: int) -> list[dict]:
    """One row per axis: {axis, size, groups, crossing, link, traffic}; `crossing` counts the
    groups whose members sit on more than one node (`Grid.crossing_groups`)."""
    rows = []
    for axis in ("tp", "pp", "dp"):
        groups = grid.groups(axis)
        crossing = grid.crossing_groups(axis, gpus_per_node)
        link = ("none (size 1)" if grid.sizes[axis] == 1 else
                "InfiniBand (crosses nodes)" if crossing else "NVLink (inside one node)")
        rows.append(dict(axis=axis, size=grid.sizes[axis], groups=groups, crossing=len(crossing),
                         link=link, traffic=TRAFFIC[axis]))
    return rows


def link_table_html(rows: list[dict]) -> str:
    """The rows of `link_table` as a small HTML table (for a notebook or an explorer)."""
    head = "<tr><th>axis</th><th>size</th><th>groups</th><th>groups crossing nodes</th><th>link</th>" \
           "<th>what it sends</th></tr>"
    body = "".join(
        f"<tr><td>{r['axis']}</td><td>{r['size']}</td><td>{html.escape(str(r['groups']))}</td>"
        f"<td>{r['crossing']} of {len(r['groups'])}</td><td>{r['link']}</td><td>{r['traffic']}</td></tr>"
        for r in rows)
    return f"<table>{head}{body}</table>"


def rank_grid_explorer(tp: int = 2, pp: int = 2, dp: int = 2, color_by: str = "tp",
                       gpus_per_node: int = 4, order: str = "tp-dp-pp"):
    """tp / pp / dp degrees, rank order, colouring axis and GPUs per node over the 3D rank cube;
    the status shows which groups cross node boundaries."""
    from mini3d.grid import Grid

    from mini3d.course.viz.widgets import _explorer, _guard

    sizes = [1, 2, 4]
    controls = dict(
        tp=W.SelectionSlider(options=sizes, value=tp, description="tp"),
        pp=W.SelectionSlider(options=sizes, value=pp, description="pp"),
        dp=W.SelectionSlider(options=sizes, value=dp, description="dp"),
        color_by=W.Dropdown(options=["tp", "pp", "dp"], value=color_by, description="colour by"),
        gpus_per_node=W.SelectionSlider(options=[1, 2, 4, 8], value=gpus_per_node,
                                        description="GPUs per node"),
        order=W.Dropdown(options=["tp-dp-pp", "dp-tp-pp", "pp-dp-tp"], value=order,
                         description="order (fastest first)"),
    )
    fig = FigureWidget(rank_cube_figure(Grid(tp, pp, dp, order), color_by, gpus_per_node))
    flat = rank_grid_2d_figure(Grid(tp, pp, dp, order), color_by, gpus_per_node, widget=True)
    status = W.HTML()

    def update():
        v = {k: c.value for k, c in controls.items()}

        def view():
            g = Grid(v["tp"], v["pp"], v["dp"], v["order"])
            return g, rank_cube_figure(g, v["color_by"], v["gpus_per_node"])

        out = _guard(status, view)
        if out is None:
            return
        g, src = out
        with fig.batch_update():
            fig.data = []
            fig.add_traces(list(src.data))
            fig.layout.title = src.layout.title
            fig.layout.meta = src.layout.meta
        src2 = rank_grid_2d_figure(g, v["color_by"], v["gpus_per_node"])
        with flat.batch_update():
            flat.data = []
            flat.add_traces(list(src2.data))
            flat.layout.update(title=src2.layout.title, xaxis=src2.layout.xaxis, yaxis=src2.layout.yaxis,
                               height=src2.layout.height, meta=src2.layout.meta)
        rows = link_table(g, v["gpus_per_node"])
        status.value = link_table_html(rows)

    box = _explorer(controls, fig, status, update, also=[flat])
    fig.layout.width = 470  # with the 2D view (440) side by side within a notebook's width
    box.children = (*box.children[:-1], W.HBox([fig, flat]))  # the cube and its 2D view side by side
    box.flat = flat
    return box


__all__ = ["TRAFFIC", "link_table", "link_table_html", "rank_grid_explorer"]
