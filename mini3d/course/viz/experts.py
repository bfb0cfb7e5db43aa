"""Chapter 10 (mixture of experts): figures of routing, capacity and all-to-all volume, and its explorer.

    routing_figure(runs, n_experts)  the busiest expert's share of the token-slots at each step,
                                     one line per aux-loss coefficient (live runs' records)
    load_figure(runs)                the last step's tokens per expert, one bar group per coefficient
    capacity_figure(rows)            dropped token-slots against the capacity factor
    a2a_figure(rows)                 bytes one GPU sends per step against ep, one line per top_k
    moe_explorer(cfg)                ep / top_k / capacity-factor sliders over the all-to-all volume
    kv_cache_figure(rows, seq_len)   one sequence's KV cache for full heads, GQA and MLA's latent

The data comes from `mini3d.course.experts` (live runs through `mini3d train`, one MoE layer of
`mini3d.models.moe`, the volume of `mini3d.cost.moe`); nothing here computes a number itself.
"""

from __future__ import annotations

import ipywidgets as W

from mini3d.course.viz.theme import CAPACITY_COLOR, GIB, gib, new_figure

COEF_COLORS = ["#c8553d", "#3b6fb6", "#2e9e5b", "#8e6bbf"]
TOPK_COLORS = {1: "#9a9a9a", 2: "#3b6fb6", 4: "#e8893a", 8: "#2e9e5b"}


def routing_figure(runs: dict, n_experts: int):
    """runs: {aux coefficient: [records with expert_load]}."""
    fig = new_figure("the busiest expert's share of each step's token-slots", "optimizer step",
                     "busiest expert's share (%)")
    for i, (coef, recs) in enumerate(runs.items()):
        fig.add_scatter(x=[r["step"] for r in recs],
                        y=[100 * max(r["expert_load"]) / sum(r["expert_load"]) for r in recs],
                        mode="lines+markers", name=f"aux-loss coef {coef:g}",
                        line_color=COEF_COLORS[i % len(COEF_COLORS)])
    fig.add_hline(y=100 / n_experts, line_color="#888", line_dash="dot")
    fig.add_scatter(x=[None], y=[None], mode="lines", line=dict(color="#888", dash="dot"),
                    name=f"balanced (1/{n_experts})")
    fig.update_yaxes(range=[0, 100])
    return fig


def load_figure(runs: dict):
    """The last step's tokens per expert, grouped by coefficient."""
    fig = new_figure("tokens per expert at the last step", "expert", "token-slots (tokens x top_k)",
                     barmode="group")
    for i, (coef, recs) in enumerate(runs.items()):
        load = recs[-1]["expert_load"]
        fig.add_bar(x=[f"expert {e}" for e in range(len(load))], y=load, name=f"aux-loss coef {coef:g}",
                    marker_color=COEF_COLORS[i % len(COEF_COLORS)])
    return fig


def capacity_figure(rows: list[dict]):
    """rows of mini3d.course.experts.capacity_rows."""
    fig = new_figure("dropped token-slots against the capacity factor", "capacity factor C (0: dropless)",
                     "dropped token-slots (%)")
    share = [100 * r["dropped"] / r["slots"] for r in rows]
    fig.add_bar(x=[f"{r['capacity_factor']:g}" for r in rows], y=share, marker_color=CAPACITY_COLOR,
                name="dropped", text=[f"{s:.0f}%" for s in share], textposition="outside")
    fig.update_yaxes(range=[0, 100])
    return fig


def a2a_figure(rows: list[dict], widget: bool = False,
               title: str = "all-to-all bytes one GPU sends per step"):
    """rows of mini3d.course.experts.a2a_rows: GiB per step against ep, one line per top_k."""
    fig = new_figure(title, "expert-parallel degree ep", "sent per step (GiB)", widget=widget)
    _a2a_traces(fig, rows)
    fig.update_xaxes(type="log", dtick=0.30102999566398)  # the powers of two
    return fig


def _a2a_traces(fig, rows: list[dict]):
    for k in sorted({r["top_k"] for r in rows}):
        mine = [r for r in rows if r["top_k"] == k]
        fig.add_scatter(x=[r["ep"] for r in mine], y=[r["step"] / GIB for r in mine], mode="lines+markers",
                        name=f"top_k={k}", line_color=TOPK_COLORS.get(k, "#8e6bbf"))


KV_COLORS = {"full": "#c8553d", "gqa": "#3b6fb6", "mla": "#2e9e5b"}


def kv_cache_figure(rows: list[dict], seq_len: int, name: str = ""):
    """rows of mini3d.course.experts.kv_cache_rows: one sequence's cache, one bar per attention,
    on a log axis (the three differ by up to two orders of magnitude)."""
    fig = new_figure(f"{name + ': ' if name else ''}KV cache of one {seq_len:,}-token sequence",
                     "what each layer caches per token", "cache (GiB, log)")
    fig.add_bar(x=[r["label"] for r in rows], y=[r["sequence"] / GIB for r in rows],
                marker_color=[KV_COLORS.get(r["kind"], "#8e6bbf") for r in rows], name="KV cache",
                text=[f"{gib(r['sequence'], 2)} ({r['per_layer']:,} numbers a layer)" for r in rows],
                textposition="outside", showlegend=False)
    fig.update_yaxes(type="log")
    return fig


def moe_view(cfg, ep: int, top_k: int, capacity_factor: float, tokens: int = 4096) -> dict:
    """What the explorer draws for one setting: the volume against every ep that divides the
    experts (lines for top_k and for top_k=1), the chosen point, and the status numbers."""
    import dataclasses

    from mini3d.course.experts import a2a_rows, balanced_kept
    from mini3d.cost.moe import experts_per_rank

    if cfg.n_experts % ep:
        raise ValueError(f"ep={ep} does not divide the {cfg.n_experts} experts")
    if top_k > cfg.n_experts:
        raise ValueError(f"top_k={top_k} is more than the {cfg.n_experts} experts")
    kept = balanced_kept(dataclasses.replace(cfg, top_k=top_k, capacity_factor=capacity_factor), tokens)
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128) if cfg.n_experts % e == 0]
    rows = a2a_rows(cfg, eps, sorted({1, top_k}), tokens, kept=kept)
    here = next(r for r in rows if r["ep"] == ep and r["top_k"] == top_k)
    return dict(rows=rows, here=here, kept=kept, experts_per_rank=experts_per_rank(cfg.n_experts, ep))


def moe_explorer(cfg, ep: int = 4, capacity_factor: float = 0.0, tokens: int = 4096):
    """Sliders ep (the divisors of n_experts), top_k and the capacity factor over `a2a_figure`;
    the status line gives the chosen point's bytes, the experts per GPU and the kept share."""
    from mini3d.course.viz.widgets import _explorer, _guard

    eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128) if cfg.n_experts % e == 0]
    controls = dict(
        ep=W.SelectionSlider(options=eps, value=ep if ep in eps else eps[-1], description="ep"),
        top_k=W.IntSlider(value=cfg.top_k, min=1, max=min(8, cfg.n_experts), description="top_k"),
        capacity_factor=W.SelectionSlider(options=[0.0, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0],
                                          value=capacity_factor, description="capacity factor (0: dropless)"))
    fig = a2a_figure([], widget=True, title=f"{cfg.name}: all-to-all bytes one GPU sends per step")
    status = W.HTML()

    def update():
        c = {k: w.value for k, w in controls.items()}
        view = _guard(status, lambda: moe_view(cfg, c["ep"], c["top_k"], c["capacity_factor"], tokens))
        if view is None:
            return
        src = a2a_figure(view["rows"])
        here = view["here"]
        with fig.batch_update():
            fig.data = []
            fig.add_traces(list(src.data))
            fig.add_scatter(x=[here["ep"]], y=[here["step"] / GIB], mode="markers", name="chosen",
                            marker=dict(size=14, color=CAPACITY_COLOR, symbol="diamond"))
        status.value = (f"ep={c['ep']}, top_k={c['top_k']}: each GPU holds {view['experts_per_rank']} of "
                        f"{cfg.n_experts} experts per MoE layer and sends {here['one'] / 2**20:,.0f} MiB per "
                        f"all-to-all, {here['step'] / GIB:,.2f} GiB per step ({tokens:,} tokens; "
                        f"{view['kept']:.0%} of the token-slots kept under balanced routing)")

    return _explorer(controls, fig, status, update)


__all__ = ["kv_cache_figure", "KV_COLORS", "a2a_figure", "capacity_figure", "load_figure", "moe_explorer", "moe_view", "routing_figure"]
