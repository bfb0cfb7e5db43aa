"""Chapter 07 (activation recomputation): memory saved against compute added, estimated and measured.

    recompute_rows(cfg, ...)       the three policies: activation bytes per GPU (estimator) and the
                                   step's compute relative to no recomputation (cost model FLOPs)
    recompute_explorer(...)        model / policy / seq_len / micro-batch / tp over the trade-off figure
    layer_ledger_bytes(acts, i)    bytes one layer saved for backward, from a live run's ledger
    measured_vs_estimated_figure   live ledgers next to the estimator, per policy, in one figure

Sources: `mini3d.cost.memory.layer_activation_bytes` (bytes a block keeps, per micro-batch,
per tp rank) and `mini3d.cost.flops.hardware_flops / model_flops` (what recomputation runs again:
the attention core under `selective`, the whole block forward under `full`).
"""

from __future__ import annotations

import ipywidgets as W

from mini3d.course.viz.memory import recompute_figure
from mini3d.course.viz.theme import CATEGORY_COLORS, new_figure

POLICIES = ("none", "selective", "full")
MIB = 2**20


def recompute_rows(cfg, seq_len: int, micro_batch: int = 1, tp: int = 1, dtype: str = "bf16",
                   sequence_parallel: bool = False) -> list[dict]:
    """One row per policy: {'policy', 'activation_bytes' (all layers of the model on one tp rank,
    one micro-batch, plus the block being recomputed under `full`), 'layer_bytes' (one block),
    'compute_factor' (hardware FLOPs / model FLOPs of a step)}."""
    from mini3d.config import Plan
    from mini3d.cost.flops import hardware_flops, model_flops
    from mini3d.cost.memory import layer_activation_bytes

    rows = []
    for policy in POLICIES:
        plan = Plan(tp=tp, recompute=policy, dtype=dtype, global_batch=micro_batch, seq_len=seq_len,
                    sequence_parallel=sequence_parallel and tp > 1)
        per_layer = layer_activation_bytes(cfg, plan)
        total = cfg.n_layers * per_layer["stored"] + (per_layer["full"] if policy == "full" else 0)
        rows.append(dict(policy=policy, activation_bytes=float(total),
                         layer_bytes=float(per_layer["stored"]),
                         compute_factor=hardware_flops(cfg, plan) / model_flops(cfg, plan)))
    return rows


def recompute_view(model: str = "gpt-22b", policy: str = "selective", seq_len: int = 2048,
                   micro_batch: int = 1, tp: int = 1) -> dict:
    """{'rows', 'chosen', 'saved_fraction', 'extra_compute'} for a preset model."""
    from mini3d.config import model_from_preset

    cfg = model_from_preset(model)
    if cfg.n_heads % tp:
        raise ValueError(f"tp={tp} does not divide n_heads={cfg.n_heads} of {model}")
    rows = recompute_rows(cfg, seq_len, micro_batch, tp)
    chosen = next(r for r in rows if r["policy"] == policy)
    none = rows[0]
    return dict(rows=rows, chosen=chosen,
                saved_fraction=1 - chosen["activation_bytes"] / none["activation_bytes"],
                extra_compute=chosen["compute_factor"] - 1)


def recompute_explorer(models=("gpt-7b", "gpt-22b", "gpt-175b"), model: str = "gpt-22b",
                       policy: str = "selective", seq_len: int = 2048, micro_batch: int = 1,
                       tp: int = 1):
    """Controls over the memory-vs-compute figure of the three policies; the chosen one is ringed."""
    controls = dict(
        model=W.Dropdown(options=list(models), value=model, description="model"),
        policy=W.Dropdown(options=list(POLICIES), value=policy, description="recompute"),
        seq_len=W.SelectionSlider(options=[512, 1024, 2048, 4096, 8192], value=seq_len,
                                  description="seq_len"),
        micro_batch=W.SelectionSlider(options=[1, 2, 4, 8], value=micro_batch,
                                      description="micro-batch"),
        tp=W.SelectionSlider(options=[1, 2, 4, 8], value=tp, description="tp"),
    )
    for c in controls.values():
        c.style.description_width = "initial"
    fig = recompute_figure([], widget=True)
    status = W.HTML()

    def update():
        q = {k: c.value for k, c in controls.items()}
        try:
            view = recompute_view(**q)
        except ValueError as e:
            status.value = f"<span style='color:#c0392b'>{e}</span>"
            return
        src = recompute_figure(view["rows"])
        c = view["chosen"]
        src.add_scatter(x=[c["compute_factor"]], y=[c["activation_bytes"] / 2**30], mode="markers",
                        marker=dict(size=22, symbol="circle-open", color="#222", line=dict(width=2)),
                        name=f"chosen: {c['policy']}", hoverinfo="skip")
        with fig.batch_update():
            fig.data = []
            fig.add_traces(list(src.data))
        fig.layout.meta = {"chosen": c}
        status.value = (f"{q['policy']}: {c['activation_bytes'] / 2**30:.2f} GiB of activations per "
                        f"micro-batch per GPU ({view['saved_fraction']:.0%} less than none), "
                        f"{view['extra_compute']:+.1%} compute per step")

    from mini3d.course.viz.widgets import _explorer

    return _explorer(controls, fig, status, update, per_row=3)


def layer_ledger_bytes(activations: dict, layer: int = 0) -> float:
    """Bytes layer `layer` saved for backward per micro-batch, from a run's `activations` ledger
    (keys such as 'layer0.attn', 'layer0.mlp' or 'layer0.block')."""
    prefix = f"layer{layer}."
    return float(sum(v for k, v in activations.items() if k.startswith(prefix)))


def measured_vs_estimated_figure(rows, title: str = "One block's saved activations: measured vs estimated"):
    """Grouped bars per policy: the live ledger's bytes next to the estimator's, in MiB per layer per
    micro-batch; each policy's label carries its compute cost (estimated, and measured if given).

    Each row: {'policy', 'measured_bytes', 'estimated_bytes', 'compute_factor'} and optionally
    'measured_time_factor' (measured step time / the `none` run's)."""
    fig = new_figure(title, "recompute policy", "saved (MiB per layer, micro-batch)")
    labels = []
    for r in rows:
        label = f"{r['policy']}<br>compute x{r['compute_factor']:.2f} est."
        if r.get("measured_time_factor") is not None:
            label += f", x{r['measured_time_factor']:.2f} measured"
        labels.append(label)
    fig.add_bar(x=labels, y=[r["measured_bytes"] / MIB for r in rows], name="measured (live ledger)",
                marker_color=CATEGORY_COLORS["activations"],
                text=[f"{r['measured_bytes'] / MIB:.3f}" for r in rows], textposition="outside")
    fig.add_bar(x=labels, y=[r["estimated_bytes"] / MIB for r in rows], name="estimated",
                marker_color="#9a9a9a", text=[f"{r['estimated_bytes'] / MIB:.3f}" for r in rows],
                textposition="outside")
    fig.update_layout(barmode="group")
    return fig


__all__ = ["recompute_rows", "recompute_view", "recompute_explorer", "layer_ledger_bytes",
           "measured_vs_estimated_figure", "POLICIES"]
