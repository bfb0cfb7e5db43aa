"""Chapters 00-01 (why 70B does not fit, memory anatomy): measured memory next to the estimate.

The live side is what `mini3d.run.train.train_worker` returns with `collect=["ledger", "activations"]`:
`ledger` holds the model-state bytes of one rank read from its live tensors (`mini3d.dp.ledger`),
`activations` the bytes saved for backward per micro-batch, by module. `measured_breakdown` turns
one rank's result into the estimator's categories; `estimated_breakdown` does the same for
`mini3d.cost.memory.estimate_memory`; `breakdown_mib_figure` draws them side by side in MiB
(a tiny model's bytes would vanish on the GiB axis of `memory_breakdown_figure`).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import plotly.graph_objects as go

from mini3d.course.viz.theme import (CATEGORIES, CATEGORY_COLORS, CATEGORY_LABELS, as_breakdown,
                                     human_bytes, new_figure)

MIB = 2 ** 20
MODEL_STATES = ("params", "grads", "optimizer")


def measured_breakdown(result: Mapping, micro_batches_in_flight: int = 1) -> dict[str, float]:
    """One rank's measured bytes by category from a `train_worker` result.

    Model states come from `result["ledger"]` (optimizer = fp32 master copy + moments + per-tensor
    scalars such as AdamW's step counter). Activations are `result["activations"]` (bytes per
    micro-batch) times the micro-batches held at once (1 without a pipeline). Communication buffers
    are not measured separately: the ledger charges gradient buckets to `grads`."""
    led = result["ledger"]
    acts = result.get("activations") or {}
    return {"params": float(led["parameters"]), "grads": float(led["gradients"]),
            "optimizer": float(led["master_weights"] + led["optimizer_states"] + led["optimizer_scalars"]),
            "activations": float(sum(acts.values())) * micro_batches_in_flight, "comm_buffers": 0.0}


def estimated_breakdown(estimate, keep: Iterable[str] = CATEGORIES) -> dict[str, float]:
    """The estimator's bytes by category, keeping only the categories in `keep` (others become 0),
    e.g. `keep=MODEL_STATES` to compare with a ledger that does not measure activations."""
    b = as_breakdown(estimate)
    keep = set(keep)
    return {c: (v if c in keep else 0.0) for c, v in b.items()}


def breakdown_mib_figure(breakdowns: Mapping[str, object], title: str = "Memory of one rank, by category",
                         x_title: str = "run (measured or estimated)") -> go.Figure:
    """Stacked bars in MiB, one per labelled breakdown ({category: bytes} or a MemoryEstimate),
    with each bar's total written above it. Labels such as '1 process · measured' and
    '1 process · estimated' next to each other make the comparison."""
    labels = list(breakdowns)
    rows = [as_breakdown(breakdowns[k]) for k in labels]
    fig = new_figure(title, x_title, "memory per rank (MiB)")
    for c in CATEGORIES:
        if not any(r[c] for r in rows):
            continue  # a category nobody holds would only clutter the legend
        fig.add_bar(x=labels, y=[r[c] / MIB for r in rows], name=CATEGORY_LABELS[c],
                    marker_color=CATEGORY_COLORS[c], hovertext=[human_bytes(r[c]) for r in rows],
                    hovertemplate="%{x}<br>" + CATEGORY_LABELS[c] + ": %{hovertext}<extra></extra>")
    totals = [sum(r.values()) for r in rows]
    fig.add_scatter(x=labels, y=[t / MIB for t in totals], mode="text", showlegend=False, name="total",
                    text=[f"{t / MIB:.2f} MiB" for t in totals], textposition="top center",
                    hoverinfo="skip")
    fig.update_layout(barmode="stack")
    return fig


def relative_gap(measured: Mapping[str, float], estimated: Mapping[str, float]) -> dict[str, float]:
    """(measured - estimated) / estimated per category that the estimate holds (0 when equal)."""
    return {c: (measured.get(c, 0.0) - v) / v for c, v in estimated.items() if v}


def training_state_bars(n_params: float, n_gpus: int,
                        state_bytes: Mapping[str, float] | None = None) -> dict[str, dict]:
    """Chapter 00's arithmetic as breakdowns for `memory_breakdown_figure`: the whole training state
    of an `n_params` model on one GPU, the same split evenly over `n_gpus` GPUs (the best any layout
    can do for model states), and the weights alone. `state_bytes` are bytes per parameter by
    category (default: mixed-precision AdamW as mini3d runs it, params 2 + fp32 grads 4 +
    optimizer 12 = 18, the estimator's rule `mini3d.cost.memory.state_bytes("bf16")`)."""
    from mini3d.cost.memory import state_bytes as rule

    sb = dict(state_bytes or zip(MODEL_STATES, rule("bf16")))
    whole = {c: n_params * sb.get(c, 0) for c in MODEL_STATES}
    return {"weights only (bf16)": {"params": n_params * sb["params"]},
            "training state, 1 GPU": whole,
            f"training state / {n_gpus} GPUs": {c: v / n_gpus for c, v in whole.items()}}


__all__ = ["measured_breakdown", "estimated_breakdown", "breakdown_mib_figure", "relative_gap",
           "training_state_bars", "MODEL_STATES"]
