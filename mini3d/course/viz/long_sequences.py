"""Chapter 07b (long sequences): what context parallelism splits, and how ring attention moves K/V.

    zigzag_figure(cp)              the causal (query chunk, key chunk) grid of 2*cp chunks, each
                                   visible block coloured by the cp rank that computes it
    ring_steps_figure(cp)          which rank's K/V block each rank holds at each ring step
    activation_rows(cfg, ...)      activation bytes per GPU against sequence length, per cp
    seq_len_figure(rows, cap)      those rows as lines, with the card's capacity
    long_sequence_explorer(...)    model / tp / cp / recompute over the memory-vs-s figure

Sources: `mini3d.cp.layout` (zig-zag chunks, block kinds) and `mini3d.cost.memory`
(`estimate_memory`: the same numbers `mini3d estimate --cp` prints).
"""

from __future__ import annotations

import ipywidgets as W

from mini3d.course.viz.theme import CAPACITY_COLOR, GIB, fit_height, new_figure

RANK_COLORS = ["#3b6fb6", "#e8893a", "#2e9e5b", "#c8553d", "#8e6bbf", "#b59a2a", "#17becf", "#9a9a9a"]


def zigzag_figure(cp: int):
    """2cp x 2cp grid of (query chunk, key chunk): diagonal blocks causal, lower ones full, upper
    ones skipped; coloured by the rank owning the query chunk. The title counts each rank's work in
    full blocks (a causal one is half): 2cp for every rank, the balance zig-zag is for."""
    from mini3d.cp.layout import block_kind, zigzag_chunks

    n = 2 * cp
    owner = {c: r for r in range(cp) for c in zigzag_chunks(r, cp)}
    work = [0.0] * cp
    fig = new_figure(f"zig-zag, cp={cp}: who computes which attention block",
                     "key chunk", "query chunk", width=120 + 55 * n, height=fit_height(1, 55 * n))
    for qc in range(n):
        for kc in range(n):
            kind = block_kind(qc, kc)
            if kind is None:
                continue
            r = owner[qc]
            work[r] += 0.5 if kind else 1.0
            fig.add_shape(type="rect", x0=kc - 0.45, x1=kc + 0.45, y0=qc - 0.45, y1=qc + 0.45,
                          fillcolor=RANK_COLORS[r % len(RANK_COLORS)], line_width=0,
                          opacity=0.5 if kind else 0.9)
            fig.add_annotation(x=kc, y=qc, text=f"r{r}" + ("◣" if kind else ""), showarrow=False)
    fig.update_xaxes(range=[-0.6, n - 0.4], dtick=1)
    fig.update_yaxes(range=[n - 0.4, -0.6], dtick=1)
    fig.update_layout(title=f"zig-zag, cp={cp}: blocks per rank " + ", ".join(
        f"r{r} {w:g}" for r, w in enumerate(work)) + " (◣ causal = half)")
    fig.layout.meta = {"work": work}
    return fig


def ring_steps_figure(cp: int):
    """Rows: cp ranks; columns: ring steps 0..cp-1; cell: the rank whose K/V block is held."""
    fig = new_figure(f"ring attention, cp={cp}: K/V block held at each step (arrow: sent onward)",
                     "ring step", "cp rank", height=fit_height(1, 50 * cp), width=160 + 90 * cp)
    for r in range(cp):
        for t in range(cp):
            j = (r - t) % cp
            fig.add_shape(type="rect", x0=t - 0.42, x1=t + 0.42, y0=r - 0.4, y1=r + 0.4, line_width=0,
                          fillcolor=RANK_COLORS[j % len(RANK_COLORS)], opacity=0.8)
            fig.add_annotation(x=t, y=r, text=f"K/V of r{j}", showarrow=False, font_color="white")
            if t + 1 < cp:
                fig.add_annotation(x=t + 0.95, y=(r + 1) % cp, ax=t + 0.45, ay=r, xref="x", yref="y",
                                   axref="x", ayref="y", showarrow=True, arrowhead=2, opacity=0.4,
                                   text="")
    fig.update_xaxes(range=[-0.6, cp - 0.4], dtick=1)
    fig.update_yaxes(range=[cp - 0.4, -0.6], dtick=1)
    return fig


def activation_rows(cfg, seq_lens, cps=(1, 2, 4, 8), tp: int = 8, recompute: str = "full",
                    attention: str = "sdpa") -> list[dict]:
    """{'seq_len', 'cp', 'activations', 'total'} bytes per GPU (one sequence per micro-batch, bf16)
    for every valid (seq_len, cp) pair."""
    import dataclasses

    from mini3d.config import Plan
    from mini3d.cost.memory import estimate_memory

    rows = []
    for s in seq_lens:
        long = dataclasses.replace(cfg, max_seq_len=max(s, cfg.max_seq_len))  # a table that long
        for cp in cps:
            plan = Plan(tp=tp, cp=cp, dtype="bf16", global_batch=1, seq_len=s, recompute=recompute,
                        attention=attention, sequence_parallel=(s // cp) % tp == 0 and tp > 1)
            if plan.problems(long):
                continue
            e = estimate_memory(long, plan)
            rows.append(dict(seq_len=s, cp=cp, activations=float(e.activations), total=float(e.total)))
    return rows


def seq_len_figure(rows: list[dict], capacity_bytes: float | None = None, widget: bool = False):
    """Memory per GPU against sequence length, one line per cp (solid total, dotted activations)."""
    fig = new_figure("memory per GPU against sequence length", "sequence length (tokens, log)",
                     "memory per GPU (GiB)", widget=widget)
    for cp in sorted({r["cp"] for r in rows}):
        mine = [r for r in rows if r["cp"] == cp]
        color = RANK_COLORS[(cp.bit_length() - 1) % len(RANK_COLORS)]
        fig.add_scatter(x=[r["seq_len"] for r in mine], y=[r["total"] / 2**30 for r in mine],
                        name=f"cp={cp} total", line_color=color, mode="lines+markers")
        fig.add_scatter(x=[r["seq_len"] for r in mine], y=[r["activations"] / 2**30 for r in mine],
                        name=f"cp={cp} activations", line=dict(color=color, dash="dot"))
    if capacity_bytes:
        fig.add_hline(y=capacity_bytes / 2**30, line_color=CAPACITY_COLOR, line_dash="dash",
                      annotation_text="capacity")
    fig.update_xaxes(type="log")
    return fig


def long_sequence_explorer(cfg, capacity_bytes: float = 80 * GIB, seq_lens=None, recompute: str = "none"):
    """tp / recompute controls over `seq_len_figure` of `cfg` (cp = 1, 2, 4, 8 as lines), with a
    status line saying the longest sequence each cp fits at the chosen tp."""
    from mini3d.course.viz.widgets import _explorer

    seq_lens = seq_lens or [2**k for k in range(11, 18)]
    controls = dict(tp=W.SelectionSlider(options=[1, 2, 4, 8], value=8, description="tp"),
                    recompute=W.Dropdown(options=["none", "full"], value=recompute,
                                         description="recompute"))
    fig = seq_len_figure([], capacity_bytes, widget=True)
    status = W.HTML()

    def update():
        rows = activation_rows(cfg, seq_lens, tp=controls["tp"].value,
                               recompute=controls["recompute"].value)
        src = seq_len_figure(rows, capacity_bytes)
        with fig.batch_update():
            fig.data = []
            fig.add_traces(list(src.data))
        status.value = f"tp={controls['tp'].value}, recompute {controls['recompute'].value}: " \
                       f"activation bytes per GPU against {capacity_bytes / 2**30:.0f} GiB"

    return _explorer(controls, fig, status, update)
