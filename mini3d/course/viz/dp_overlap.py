"""Chapter 02 (data parallelism): loss parity, a measured overlap timeline, the communication tax.

`dp_step_windows(events)` reads one rank's comm event log (`train_worker(..., collect=["events"])`)
and cuts it into optimizer steps. Each step of `train_worker` ends with a one-element float64
all-reduce of the loss over dp (`Trainer.mean_loss_over_dp`), so the end of that event marks the end
of a step, and the previous one's end the start of the next: step k's window runs between them (the
first step has no start marker and is skipped). Inside a window, every other dp all-reduce is a
gradient bucket: issued (`start`) by the backward hook the moment its last gradient arrived, and
completed (`end`) when the optimizer step waited for it. Times as the event log's snapshot gives
them (`comm_log.Event.as_dict`): the host's perf_counter on CPU; on CUDA the GPU's (issue on the
compute stream, the op's completion on the GPU, so `end` is when it finished, not the wait). `dp_overlap_figure` draws that.

`dp_scaling_rows` asks the analytic cost model (`mini3d.cost.model.estimate_cost`) what N GPUs of
pure data parallelism are worth at a fixed global batch, for `scaling_efficiency_figure`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

from mini3d.course.viz.figure_widget import FigureWidget
from mini3d.course.viz.theme import AXIS_COLORS, fit_height, new_figure


def _is_loss_marker(ev: Mapping) -> bool:
    return ev["op"] == "all_reduce" and tuple(ev["shape"]) == (1,) and ev["dtype"] == "float64"


def dp_step_windows(events: Sequence[Mapping], axis: str = "dp") -> list[dict]:
    """Per measured step: {'step', 't0', 't1', 'buckets': [(start, end, bytes), ...]} with times in
    seconds relative to the step's start `t0` (so t0 = 0.0 and t1 is the step's length)."""
    evs = [e for e in events if e["axis"] == axis and e.get("end") is not None]
    markers = [e for e in evs if _is_loss_marker(e)]
    out = []
    for prev, cur in zip(markers, markers[1:]):
        t0, t1 = prev["end"], cur["end"]
        buckets = [(e["start"] - t0, e["end"] - t0, int(e["bytes"])) for e in evs
                   if not _is_loss_marker(e) and e["op"] == "all_reduce" and t0 <= e["start"] < t1]
        out.append({"step": int(cur["context"].get("step", len(out) + 1)), "t0": 0.0, "t1": t1 - t0,
                    "buckets": sorted(buckets)})
    return out


def overlap_summary(window: Mapping) -> dict:
    """How much of a step the gradient buckets were in flight while backward was still producing
    gradients: from the first bucket's issue to the last bucket's issue (seconds), next to the step."""
    b = window["buckets"]
    if not b:
        return {"n_buckets": 0, "overlap_window_s": 0.0, "step_s": window["t1"]}
    return {"n_buckets": len(b), "overlap_window_s": b[-1][0] - b[0][0], "step_s": window["t1"],
            "first_issue_s": b[0][0], "last_end_s": max(e for _, e, _ in b)}


def dp_overlap_figure(runs: Mapping[str, Sequence[dict]],
                      title: str = "Measured: gradient all-reduces inside each step (rank 0)") -> go.Figure:
    """One row per (run, step): a grey bar for the whole step and one bar per gradient bucket, from
    the moment it was issued to the moment it was waited for. `runs` maps a label (e.g. 'buckets of
    0.1 MiB') to `dp_step_windows(...)` of that run."""
    fig = new_figure(title, "time since the step started (ms)", "run and step")
    rows, steps, buckets = [], dict(base=[], x=[], y=[]), dict(base=[], x=[], y=[], text=[])
    for label, windows in runs.items():
        for w in windows:
            row = f"{label} · step {w['step']}"
            rows.append(row)
            steps["base"].append(0.0), steps["x"].append(1e3 * w["t1"]), steps["y"].append(row)
            for i, (s, e, nbytes) in enumerate(w["buckets"]):
                buckets["base"].append(1e3 * s), buckets["x"].append(1e3 * (e - s))
                buckets["y"].append(row), buckets["text"].append(f"bucket {i}: {nbytes / 2**20:.2f} MiB")
    fig.add_bar(orientation="h", name="step (forward, backward, optimizer)", marker_color="#e6e6e6",
                width=0.8, hovertemplate="step: %{x:.1f} ms<extra></extra>", **steps)
    # textposition="none": the bucket names only in the hover (drawn, dozens of them covered each other)
    fig.add_bar(orientation="h", name="gradient all-reduce (issued -> waited for)", width=0.4, textposition="none",
                marker=dict(color=AXIS_COLORS["dp"], opacity=0.75, line=dict(color="white", width=1)),
                hovertemplate="%{text}<br>issued at %{base:.1f} ms, lasted %{x:.1f} ms<extra></extra>",
                **buckets)
    fig.update_layout(barmode="overlay", height=fit_height(1, 40 * len(rows)))  # not squashed at 1 row
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(rows)))
    return fig


def loss_curves_figure(curves: Mapping[str, Sequence[float]],
                       title: str = "Loss per optimizer step") -> go.Figure:
    """One line per run: `curves` maps a label to its loss per step (step 1 first)."""
    fig = new_figure(title, "optimizer step (count)", "training loss (nats per token)")
    for i, (label, losses) in enumerate(curves.items()):
        fig.add_scatter(x=list(range(1, len(losses) + 1)), y=list(losses), name=label,
                        mode="lines+markers", line=dict(dash="dot" if i else "solid"),
                        marker=dict(size=10 if i == 0 else 6))
    return fig


def dp_scaling_rows(cfg, hw, gpus: Sequence[int], global_batch: int, seq_len: int, zero: int = 1,
                    dtype: str = "bf16") -> list[dict]:
    """Pure data parallelism (ZeRO-`zero`) of `cfg` on N GPUs of `hw` at a fixed global batch (one
    sequence per micro-batch). Efficiency = tokens/s per GPU on N GPUs / tokens/s of one GPU that
    does the same work without any communication (compute + optimizer only)."""
    from mini3d.config import Plan
    from mini3d.cost.model import estimate_cost

    rows = []
    for n in gpus:
        plan = Plan(dp=n, zero=zero if n > 1 else 0, global_batch=global_batch, seq_len=seq_len,
                    dtype=dtype, micro_batches=global_batch // n)
        c = estimate_cost(cfg, plan, hw, n)
        ideal = c.breakdown["compute"] + c.breakdown["optimizer"]
        rows.append({"gpus": n, "step_time_s": c.step_time_s, "ideal_step_s": ideal,
                     "efficiency": ideal / c.step_time_s, "dp_exposed_s": c.breakdown["dp_exposed"]})
    return rows


__all__ = ["dp_step_windows", "overlap_summary", "dp_overlap_figure", "loss_curves_figure",
           "dp_scaling_rows"]


# ---------------------------------------------------------------- the communication-tax explorer


def cost_model_scaling_fn(gpu: str = "A100-80GB", seq_len: int = 2048,
                          gpus: Sequence[int] = (1, 8, 32, 128, 512, 1024), zero: int = 1):
    """`rows_fn(model, global_batch, internode_gbps)` for `scaling_explorer`, backed by the cost
    model: `dp_scaling_rows` (ZeRO-`zero`) on the preset GPU with its inter-node bandwidth replaced."""
    import dataclasses

    from mini3d.config import model_from_preset
    from mini3d.cost.hardware import PRESETS as HARDWARE

    def rows_fn(model="gpt-1.3b", global_batch=2048, internode_gbps=25.0):
        hw = dataclasses.replace(HARDWARE[gpu], internode_bw=float(internode_gbps) * 1e9)
        usable = [n for n in gpus if global_batch % n == 0]
        if not usable:
            raise ValueError(f"global_batch={global_batch} is not divisible by any GPU count in {list(gpus)}")
        return dp_scaling_rows(model_from_preset(model), hw, usable, global_batch, seq_len, zero=zero)

    return rows_fn


def scaling_view(rows_fn, **query) -> dict:
    """{'gpus', 'efficiency', 'effective'} for one (model, global batch, bandwidth) query."""
    rows = rows_fn(**query)
    gpus = [r["gpus"] for r in rows]
    eff = [float(r["efficiency"]) for r in rows]
    return {"gpus": gpus, "efficiency": eff, "effective": [g * e for g, e in zip(gpus, eff)]}


def scaling_explorer(rows_fn, models=("gpt-1.3b", "gpt-7b"), model="gpt-1.3b", global_batch=2048,
                     internode_gbps=25.0):
    """Model, global batch and inter-node bandwidth controls over 'what N GPUs are really worth'."""
    import ipywidgets as W

    from mini3d.course.viz.comm import scaling_efficiency_figure
    from mini3d.course.viz.widgets import _explorer, _guard, _redraw_bars

    controls = dict(
        model=W.Dropdown(options=list(models), value=model, description="model"),
        global_batch=W.SelectionSlider(options=[256, 512, 1024, 2048, 4096, 8192], value=global_batch,
                                       description="global batch (sequences)"),
        internode_gbps=W.SelectionSlider(options=[12.5, 25.0, 50.0, 100.0, 200.0], value=internode_gbps,
                                         description="inter-node GB/s per GPU"),
    )
    for c in controls.values():
        c.style.description_width = "initial"
    fig = FigureWidget(scaling_efficiency_figure([], []))
    status = W.HTML()

    def update():
        q = {k: c.value for k, c in controls.items()}
        view = _guard(status, lambda: scaling_view(rows_fn, **q))
        if view is None:
            return
        _redraw_bars(fig, scaling_efficiency_figure(view["gpus"], view["efficiency"]))
        fig.update_xaxes(tickvals=view["gpus"])
        fig.update_yaxes(tickvals=view["gpus"])
        status.value = (f"{view['gpus'][-1]} GPUs work like <b>{view['effective'][-1]:.0f}</b> "
                        f"({view['efficiency'][-1]:.0%} efficiency)")

    return _explorer(controls, fig, status, update)


__all__ += ["cost_model_scaling_fn", "scaling_view", "scaling_explorer"]
