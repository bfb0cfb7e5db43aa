"""Chapter 04 (tensor parallelism): shard pictures from `mini3d.tp.shard_map`, the tp event log of a
live run, and per-layer time on NVLink vs across nodes (with an explorer).

* `shard_map_figure(shard_map(cfg, tp), tp)` draws, for each weight matrix, which tp_rank owns each
  block. It reads the index ranges `apply_tp` slices with, so the picture cannot disagree with the
  code (fused QKV shows its three separate row ranges per rank: whole heads of q, k and v).
  Linear weights are drawn as (in_features x out_features), the way the maths writes X @ A, so a
  column-parallel layer splits the picture's columns; the embedding table is drawn as stored
  (vocabulary x hidden).
* `tp_event_counts(events)` groups the tp collectives of one step of a live run.
* `tp_layer_times(...)` / `tp_link_figure(rows)` / `tp_link_explorer()` put one layer's compute next
  to its tp communication (`mini3d.tp.comm_per_layer`) at NVLink and at inter-node speed.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import ipywidgets as W
from plotly.subplots import make_subplots

from mini3d.course.viz.theme import AXIS_COLORS, CAPACITY_COLOR, TEMPLATE_NAME, new_figure
from mini3d.course.viz.tp import _RANK_COLORS

# ---------------------------------------------------------------- which block lives where


def _owner(ranks: list[dict], key: str, index: int) -> int:
    for r in ranks:
        if any(a <= index < b for a, b in r.get(key, [])):
            return int(r["tp_rank"])
    return -1  # not split along this dim: every rank holds it


def shard_blocks(entry: dict, cells: int = 24) -> dict:
    """Owner grid of one `shard_map` entry, in picture orientation.

    Returns {'z': rows of tp_ranks, 'x': column start indices, 'y': row start indices,
    'x_title', 'y_title', 'split_axis' ('x' or 'y')}."""
    out_dim, in_dim = entry["shape"]  # torch layout (dim 0, dim 1)
    embedding = entry["name"].startswith("embed")
    key = "rows" if entry["dim"] == 0 else "cols"
    if embedding:  # drawn as stored: rows = vocabulary (dim 0), columns = hidden (dim 1)
        n_rows, n_cols, split_axis = out_dim, in_dim, ("y" if entry["dim"] == 0 else "x")
        y_title, x_title = "vocabulary row (token id)", "hidden feature (index)"
    else:  # Linear (out, in) drawn transposed as (in x out); torch dim 0 -> picture columns
        n_rows, n_cols, split_axis = in_dim, out_dim, ("x" if entry["dim"] == 0 else "y")
        y_title, x_title = "input feature (index)", "output feature (index)"
    nx, ny = min(n_cols, cells), min(n_rows, cells)
    xs = [j * n_cols // nx for j in range(nx)]
    ys = [i * n_rows // ny for i in range(ny)]
    mid = lambda starts, n, k: (starts[k] + (starts[k + 1] if k + 1 < len(starts) else n)) // 2  # noqa: E731
    z = []
    for i in range(ny):
        row = []
        for j in range(nx):
            idx = mid(xs, n_cols, j) if split_axis == "x" else mid(ys, n_rows, i)
            row.append(_owner(entry["ranks"], key, idx))
        z.append(row)
    return dict(z=z, x=xs, y=ys, x_title=x_title, y_title=y_title, split_axis=split_axis)


def shard_map_figure(smap: Sequence[dict], tp: int, cells: int = 24, names: Sequence[str] | None = None,
                     title: str | None = None):
    """One panel per matrix of `mini3d.tp.shard_map(cfg, tp)` (optionally only `names`), blocks
    coloured by owning tp_rank. `fig.layout.meta['owners'][name]` holds each panel's owner grid."""
    entries = [e for e in smap if names is None or e["name"] in names]
    fig = make_subplots(rows=1, cols=len(entries), horizontal_spacing=0.08,
                        subplot_titles=[f"{e['name']}<br><sub>{e['kind']}</sub>" for e in entries])
    ranks = list(range(-1, tp))
    scale = []
    for k, r in enumerate(ranks):
        color = "#cccccc" if r < 0 else _RANK_COLORS[r % len(_RANK_COLORS)]
        scale += [[k / len(ranks), color], [(k + 1) / len(ranks), color]]
    owners = {}
    for i, e in enumerate(entries, start=1):
        b = shard_blocks(e, cells)
        owners[e["name"]] = b["z"]
        fig.add_heatmap(z=b["z"], x=b["x"], y=b["y"], zmin=-1.5, zmax=tp - 0.5, colorscale=scale,
                        showscale=(i == len(entries)), xgap=1, ygap=1, name=e["name"],
                        colorbar=dict(title="tp_rank", tickvals=ranks,
                                      ticktext=["all"] + [str(r) for r in range(tp)]),
                        hovertemplate="row %{y}, col %{x}: tp_rank %{z}<extra></extra>", row=1, col=i)
        fig.update_xaxes(title_text=b["x_title"], row=1, col=i)
        fig.update_yaxes(title_text=b["y_title"], autorange="reversed", row=1, col=i)
    fig.update_layout(template=TEMPLATE_NAME, height=420, margin=dict(t=110),
                      title=title or f"Tensor parallelism: who holds which block (tp={tp})")
    fig.layout.meta = {"owners": owners}
    return fig


# ---------------------------------------------------------------- the event log of a live run


def tp_event_counts(events: Sequence[dict], step: int = 0, axis: str = "tp") -> list[dict]:
    """Collectives on `axis` during optimizer step `step`: [{op, shape, bytes, count}], most first."""
    c = Counter((e["op"], tuple(e["shape"]), int(e["bytes"])) for e in events
                if e["axis"] == axis and e.get("context", {}).get("step") == step)
    rows = [dict(op=op, shape=shape, bytes=nb, count=n) for (op, shape, nb), n in c.items()]
    return sorted(rows, key=lambda r: (-r["count"], -r["bytes"]))


# ---------------------------------------------------------------- NVLink vs across nodes


def tp_layer_times(cfg, hw, tps: Sequence[int] = (1, 2, 4, 8), seq_len: int | None = None,
                   micro_batch_size: int = 1, dtype: str = "bf16") -> list[dict]:
    """Per tp degree: one layer's forward+backward compute time per GPU and its tp communication
    time (2 all-reduces forward, 2 backward, `mini3d.tp.comm_per_layer`) on NVLink and across nodes.

    Compute uses mini3d.cost's FLOP count and efficiency model (narrower per-GPU matmuls run further
    from peak); communication is `Hardware.collective_s` of each op (ring wire bytes / link
    bandwidth + one latency per ring step), not overlapped with compute (as in Megatron-LM)."""
    from mini3d.cost.model import efficiency_for
    from mini3d.cost.flops import flops_per_token
    from mini3d.tp import comm_per_layer

    s = seq_len or cfg.max_seq_len
    e = 2 if dtype == "bf16" else 4
    eff = efficiency_for(hw)
    layer_flops = 3 * flops_per_token(cfg, s)["layer"] * micro_batch_size * s
    rows = []
    for t in tps:
        c = comm_per_layer(t, micro_batch_size, s, cfg.d_model, False, e)
        wire, ops = c["forward_wire_bytes"] + c["backward_wire_bytes"], c["forward_ops"] + c["backward_ops"]
        rate = hw.flops(dtype) * eff.at(min(cfg.d_model / t, micro_batch_size * s))

        def comm_s(bw):
            return sum(o["count"] * hw.collective_s(o["op"], t, o["bytes"], bw)
                       for o in c["forward"] + c["backward"])
        rows.append(dict(tp=t, compute_s=layer_flops / t / rate, wire_bytes=wire, ops=ops,
                         comm_nvlink_s=comm_s(hw.nvlink_bw), comm_internode_s=comm_s(hw.internode_bw)))
    return rows


def tp_link_figure(rows: Sequence[dict], title: str = "One transformer layer, forward + backward"):
    """Stacked bars (compute + tp communication, ms) for each tp degree inside one node (NVLink) and
    spread across nodes; a dashed line marks one GPU's time. meta['totals_ms'] maps bar -> total."""
    fig = new_figure(title, "tensor-parallel degree and link", "time per layer (ms)")
    labels, comp, comm = [], [], []
    for r in rows:
        links = [("one GPU", 0.0)] if r["tp"] == 1 else [("NVLink", r["comm_nvlink_s"]),
                                                          ("across nodes", r["comm_internode_s"])]
        for link, c in links:
            labels.append(f"tp={r['tp']}<br>{link}")
            comp.append(1e3 * r["compute_s"])
            comm.append(1e3 * c)
    fig.add_bar(x=labels, y=comp, name="compute", marker_color="#3b6fb6",
                hovertemplate="%{x}: compute %{y:.2f} ms<extra></extra>")
    fig.add_bar(x=labels, y=comm, name="tp communication", marker_color=AXIS_COLORS["tp"],
                hovertemplate="%{x}: all-reduces %{y:.2f} ms<extra></extra>")
    one = next((1e3 * r["compute_s"] for r in rows if r["tp"] == 1), None)
    if one is not None:
        fig.add_hline(y=one, line=dict(color=CAPACITY_COLOR, dash="dash"),
                      annotation_text=f"one GPU: {one:.2f} ms", annotation_position="top right")
    fig.update_layout(barmode="stack", height=420)
    fig.layout.meta = {"totals_ms": {lab.replace("<br>", " "): a + b for lab, a, b in zip(labels, comp, comm)}}
    return fig


def tp_link_view(model: str = "gpt2-small", hardware: str = "A100-80GB", seq_len: int = 1024,
                 tps: Sequence[int] = (1, 2, 4, 8)) -> dict:
    """{'rows', 'figure', 'verdict'} for a preset model on a hardware preset."""
    from mini3d.config import model_from_preset
    from mini3d.cost.hardware import load_hardware

    cfg, hw = model_from_preset(model), load_hardware(hardware)
    rows = tp_layer_times(cfg, hw, tps, seq_len)
    fig = tp_link_figure(rows, title=f"{model}, one layer (seq {seq_len}) on {hardware}")
    one = rows[0]["compute_s"]
    r2 = next(r for r in rows if r["tp"] == 2)
    across = r2["compute_s"] + r2["comm_internode_s"]
    verdict = (f"tp=2 across two nodes: {1e3 * across:.2f} ms per layer vs {1e3 * one:.2f} ms on one GPU "
               f"({'slower' if across > one else 'faster'}); inside one node: "
               f"{1e3 * (r2['compute_s'] + r2['comm_nvlink_s']):.2f} ms")
    return dict(rows=rows, figure=fig, verdict=verdict)


def tp_link_explorer(models=("gpt2-small", "gpt-1.3b", "gpt-7b", "llama-3.1-70b"), model: str = "gpt2-small",
                     hardware: str = "A100-80GB", seq_len: int = 1024):
    """Model, hardware and sequence-length controls over `tp_link_figure`."""
    from mini3d.cost.hardware import PRESETS as HW

    from mini3d.course.viz.widgets import _explorer, _guard, _redraw_bars

    controls = dict(
        model=W.Dropdown(options=list(models), value=model, description="model"),
        hardware=W.Dropdown(options=list(HW), value=hardware, description="GPU"),
        seq_len=W.SelectionSlider(options=[256, 512, 1024, 2048, 4096, 8192], value=seq_len,
                                  description="sequence length"),
    )
    fig = new_figure("One transformer layer", "tensor-parallel degree and link", "time per layer (ms)",
                     widget=True)
    status = W.HTML()

    def update():
        view = _guard(status, lambda: tp_link_view(**{k: c.value for k, c in controls.items()}))
        if view is None:
            return
        _redraw_bars(fig, view["figure"])
        fig.layout.title = view["figure"].layout.title
        fig.layout.meta = view["figure"].layout.meta
        status.value = view["verdict"]

    return _explorer(controls, fig, status, update)


__all__ = ["shard_blocks", "shard_map_figure", "tp_event_counts", "tp_layer_times", "tp_link_figure",
           "tp_link_view", "tp_link_explorer"]
