"""The course's running 70B scenario: one GPU's memory and one step's time, chapter after chapter.

    story_rows(layouts)    {label: plan options or a Plan} -> one row per layout: the memory of
                           the hungriest rank by category and the step time by term, both from
                           mini3d.cost (estimate_cost, which also returns estimate_memory's bytes)
    story_lines(rows)      one printed sentence per row (the numbers a chapter's text quotes)
    story_figure(rows)     two small panels: per-GPU memory (GiB) against the GPU's capacity, and
                           the step-time breakdown (compute, exposed communication per axis, bubble)

Every chapter that changes the memory or the step time ends its main section with one cell:

    show_story({"dp=8": dict(dp=8), "dp=8 ZeRO-3": dict(dp=8, zero=3)})

The model and GPU are `mini3d.course.story.MODEL_70B` / `GPU_70B`; the batch is the one of
chapter 00 (`STORY_BATCH`). Nothing is computed here: the numbers are the cost model's.
"""

from __future__ import annotations

from plotly.subplots import make_subplots

from mini3d.cost.model import TIME_TERMS
from mini3d.course.viz.planning import TERM_COLORS, TERM_LABELS
from mini3d.course.viz.theme import (CAPACITY_COLOR, CATEGORY_COLORS, CATEGORY_LABELS, LEGEND_RIGHT, TEMPLATE_NAME,
                                     to_gib)

STORY_BATCH = dict(global_batch=64, seq_len=4096, dtype="bf16")  # chapter 00's 64 x 4096 tokens
MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "comm_buffers")
# The step-time terms: mini3d.cost.model.TIME_TERMS, which add up to estimate_cost's step_time_s.


def story_plan(options):
    """A `Plan` of the story: chapter 00's batch, one sequence per micro-batch unless told."""
    from mini3d.config import Plan

    if isinstance(options, Plan):
        return options
    opts = dict(STORY_BATCH, **options)
    opts.setdefault("micro_batches", opts["global_batch"] // opts.get("dp", 1))
    return Plan(**opts)


def story_rows(layouts: dict, model: str | None = None, gpu: str | None = None) -> list[dict]:
    """One row per labelled layout: label, gpus, memory {category: bytes} of the rank that needs
    the most, capacity_bytes, fits, time {term: seconds}, step_time_s, bubble_fraction."""
    from mini3d.config import model_from_preset
    from mini3d.cost.hardware import load_hardware
    from mini3d.cost.model import estimate_cost

    from mini3d.course.story import GPU_70B, MODEL_70B

    cfg, hw = model_from_preset(model or MODEL_70B), load_hardware(gpu or GPU_70B)
    rows = []
    for label, options in layouts.items():
        plan = story_plan(options)
        est = estimate_cost(cfg, plan, hw, plan.world_size)
        rows.append(dict(label=label, gpus=plan.world_size, plan=plan,
                         memory={c: float(getattr(est.memory, c)) for c in MEMORY_TERMS},
                         capacity_bytes=float(est.capacity_bytes), fits=bool(est.fits),
                         time={t: float(est.breakdown[t]) for t in TIME_TERMS},
                         step_time_s=float(est.step_time_s), bubble_fraction=float(est.bubble_fraction)))
    return rows


def story_lines(rows: list[dict]) -> str:
    """'label (N GPUs): X GiB per GPU (fits in 80 GiB / does not fit), step Y s (bubble Z%)'."""
    out = []
    for r in rows:
        total = sum(r["memory"].values())
        fit = "fits" if r["fits"] else "does NOT fit"
        out.append(f"{r['label']} ({r['gpus']} GPU{'' if r['gpus'] == 1 else 's'}): {to_gib(total):,.1f} GiB per GPU ({fit} in "
                   f"{to_gib(r['capacity_bytes']):.0f} GiB), step {r['step_time_s']:.2f} s, "
                   f"bubble {r['bubble_fraction']:.0%}")
    return "\n".join(out)


def story_figure(rows: list[dict], title: str | None = None):
    """Memory per GPU (left, GiB, stacked by category, capacity dashed) and step time (right,
    seconds, stacked by term), one bar per layout."""
    from mini3d.course.story import GPU_70B, MODEL_70B

    labels = [r["label"] for r in rows]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.14,
                        subplot_titles=("memory per GPU (GiB)", "step time (s)"))
    for c in MEMORY_TERMS:
        ys = [to_gib(r["memory"][c]) for r in rows]
        if any(ys):
            fig.add_bar(x=labels, y=ys, name=CATEGORY_LABELS[c], marker_color=CATEGORY_COLORS[c],
                        legendgroup="memory", legendgrouptitle_text="memory", row=1, col=1)
    for t in TIME_TERMS:
        ys = [r["time"][t] for r in rows]
        if any(ys):
            fig.add_bar(x=labels, y=ys, name=TERM_LABELS[t], marker_color=TERM_COLORS[t],
                        legendgroup="time", legendgrouptitle_text="step time", row=1, col=2)
    if rows:  # the capacity line on the memory panel, named in the legend (not over the bars)
        cap, line = to_gib(rows[0]["capacity_bytes"]), dict(color=CAPACITY_COLOR, dash="dash", width=2)
        fig.add_hline(y=cap, line=line, row=1, col=1)
        fig.add_scatter(x=[None], y=[None], mode="lines", line=line, name=f"GPU capacity {cap:.0f} GiB",
                        hoverinfo="skip", legendgroup="memory", row=1, col=1)
        top = max([cap] + [to_gib(sum(r["memory"].values())) for r in rows])
        fig.update_yaxes(range=[0, 1.1 * top], row=1, col=1)
    fig.update_layout(template=TEMPLATE_NAME, barmode="stack", height=520, margin=dict(t=90),
                      title=title or f"The 70B story: {MODEL_70B} on {GPU_70B}",
                      legend=dict(font=dict(size=11), groupclick="toggleitem", **LEGEND_RIGHT), meta={"rows": [_meta(r) for r in rows]})
    return fig


def _meta(row: dict) -> dict:
    return {k: row[k] for k in ("label", "gpus", "memory", "time", "step_time_s", "fits")}


def show_story(layouts: dict, title: str | None = None, **kw):
    """Print `story_lines` and return `story_figure` (the one cell each chapter runs)."""
    from mini3d.course.story import GPU_70B, MODEL_70B

    rows = story_rows(layouts, **kw)
    b = STORY_BATCH
    print(f"{kw.get('model') or MODEL_70B} on {kw.get('gpu') or GPU_70B}, global batch {b['global_batch']} "
          f"sequences of {b['seq_len']:,} tokens, {b['dtype']}:")
    print(story_lines(rows))
    return story_figure(rows, title)


__all__ = ["STORY_BATCH", "TIME_TERMS", "story_plan", "story_rows", "story_lines", "story_figure",
           "show_story"]
