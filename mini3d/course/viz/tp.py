"""Tensor-parallel shard pictures: which slice of each weight matrix lives on which tp rank.

A matrix is described by plain data: {'name', 'rows', 'cols', 'split'} with split 'col' (the output
dim is cut, Megatron's column-parallel layer), 'row' (the input dim is cut, row-parallel) or 'none'
(replicated, e.g. LayerNorm). Weights are drawn as (in_features x out_features), so 'col' splits the
picture's columns. Each matrix is shown as a grid of at most `cells` x `cells` blocks coloured by
the owning tp_rank (-1 = replicated on every rank).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mini3d.course.viz.theme import TEMPLATE_NAME

_RANK_COLORS = ["#3b6fb6", "#e8893a", "#2e9e5b", "#c8553d", "#8e6bbf", "#b59a2a", "#17becf", "#e377c2"]


def megatron_mlp(d_model: int, d_ff: int | None = None) -> list[dict]:
    """The two MLP matrices of a Megatron block: W_up column-parallel, W_down row-parallel."""
    f = d_ff or 4 * d_model
    return [dict(name="MLP up W1", rows=d_model, cols=f, split="col"),
            dict(name="MLP down W2", rows=f, cols=d_model, split="row")]


def megatron_attention(d_model: int) -> list[dict]:
    """Attention: fused QKV column-parallel (whole heads per rank), out-projection row-parallel."""
    return [dict(name="attention QKV", rows=d_model, cols=3 * d_model, split="col"),
            dict(name="attention out", rows=d_model, cols=d_model, split="row")]


def shard_owner_grid(rows: int, cols: int, split: str, tp: int, cells: int = 16) -> list[list[int]]:
    """Block grid (≤ cells x cells) of owning tp ranks; the split dim must divide by tp."""
    if split not in ("col", "row", "none"):
        raise ValueError(f"split={split!r} must be 'col', 'row' or 'none'")
    dim = {"col": cols, "row": rows}.get(split)
    if dim is not None and dim % tp:
        raise ValueError(f"tp={tp} does not divide the {split} dim {dim}")
    n_r = min(rows, max(cells, tp if split == "row" else 1))
    n_c = min(cols, max(cells, tp if split == "col" else 1))
    # Round block counts to a multiple of tp so block boundaries fall on shard boundaries.
    if split == "row":
        n_r = max(tp, n_r - n_r % tp)
    if split == "col":
        n_c = max(tp, n_c - n_c % tp)
    grid = []
    for i in range(n_r):
        row = []
        for j in range(n_c):
            if split == "none":
                row.append(-1)
            else:
                idx, n = (j, n_c) if split == "col" else (i, n_r)
                row.append(idx * tp // n)
        grid.append(row)
    return grid


def tp_shard_figure(matrices: Sequence[Mapping], tp: int, cells: int = 16,
                    title: str | None = None) -> go.Figure:
    """One heatmap-like panel per matrix, blocks coloured by the tp_rank that holds them."""
    n = len(matrices)
    fig = make_subplots(rows=1, cols=n, subplot_titles=[
        f"{m['name']} ({m['rows']}×{m['cols']}, {m['split']}-parallel)" for m in matrices])
    scale, ranks = [], list(range(-1, tp))
    for k, r in enumerate(ranks):  # discrete colour scale: one flat band per rank
        color = "#cccccc" if r < 0 else _RANK_COLORS[r % len(_RANK_COLORS)]
        scale += [[k / len(ranks), color], [(k + 1) / len(ranks), color]]
    for i, m in enumerate(matrices, start=1):
        z = shard_owner_grid(int(m["rows"]), int(m["cols"]), str(m["split"]), tp, cells)
        fig.add_heatmap(z=z, zmin=-1.5, zmax=tp - 0.5, colorscale=scale, showscale=(i == n), xgap=1, ygap=1,
                        colorbar=dict(title="tp_rank", tickvals=ranks,
                                      ticktext=["all"] + [str(r) for r in range(tp)]),
                        hovertemplate="block (%{y}, %{x}) on tp_rank %{z}<extra></extra>",
                        row=1, col=i)
        fig.update_xaxes(title_text=f"out_features (blocks of {max(1, m['cols'] // len(z[0]))})",
                         row=1, col=i)
        fig.update_yaxes(title_text=f"in_features (blocks of {max(1, m['rows'] // len(z))})",
                         autorange="reversed", row=1, col=i)
    fig.update_layout(template=TEMPLATE_NAME, title=title or f"Tensor parallelism: shards on tp={tp} ranks",
                      height=380)
    return fig


__all__ = ["tp_shard_figure", "shard_owner_grid", "megatron_mlp", "megatron_attention"]
