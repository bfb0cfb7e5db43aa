"""Chapter 08 (debugging OOM and hangs): pictures of a failed run, read from its run directory.

    load_dumps(run_dir)          {rank: dump} from the rank*.json files the watchdog wrote
    hang_timeline_figure(dumps)  each rank's communication ops on one time axis; ops still pending
                                 when the job stopped are drawn hatched yellow up to the moment of the dump
    oom_figure(oom)              the OOM report as bars: measured + the failed request vs the
                                 estimate, against the memory budget

Both figures take plain data (the dump dicts), so they can be tested without starting a job.
"""

from __future__ import annotations

import glob
import json
import os
import re

from mini3d.course.viz.theme import (AXIS_COLORS, CAPACITY_COLOR, CATEGORIES, CATEGORY_COLORS,
                                     CATEGORY_LABELS, new_figure)


def load_dumps(run_dir: str) -> dict:
    """{rank: dump dict} of every rank*.json of the job `run_dir` holds (its latest failed job's
    RUN_DIR/job-<id>, `diagnose.run_dir.pick_job`; ranks that left none are absent)."""
    from mini3d.diagnose.run_dir import pick_job

    out = {}
    for path in glob.glob(os.path.join(pick_job(run_dir)[0], "rank*.json")):
        m = re.fullmatch(r"rank(\d+)\.json", os.path.basename(path))
        if m:
            with open(path) as f:
                out[int(m.group(1))] = json.load(f)
    return dict(sorted(out.items()))


def _label(rank: int, dump: dict) -> str:
    c = dump.get("coords") or {}
    return f"rank {rank} (" + " ".join(f"{k}={c[k]}" for k in ("tp", "pp", "dp") if k in c) + ")"


# Pending ops: black hatching on pale yellow, told apart from every axis colour (the pp axis is a red)
# by lightness and pattern, not by hue alone, so colour-blind readers see the difference too.
PENDING_COLOR, PENDING_PATTERN = "#ffe98a", "/"
PENDING_LOOK = "hatched in black on pale yellow, labelled to the right of the bar"  # chapter 08 quotes it


def _op_marker(axis: str, done: bool) -> dict:
    if done:
        return dict(color=AXIS_COLORS.get(axis, "#888"), line=dict(width=1, color="white"))
    return dict(color=PENDING_COLOR, pattern=dict(shape=PENDING_PATTERN, fgcolor="#222", solidity=0.3),
                line=dict(width=1.5, color="#222"))


def hang_timeline_figure(dumps: dict, world: int | None = None,
                         title: str = "What each rank was doing when the job stopped"):
    """One row per rank, one bar per logged op (start to end, seconds since the first op of any
    rank). Pending ops run to `start + age_s` (the dump), drawn as PENDING_LOOK says (their label outside
    the bar, where the hatching cannot hide it); ranks without a dump (killed)
    get an empty, labelled row. `fig.layout.meta['pending']` lists (rank, op, axis, seq)."""
    fig = new_figure(title, "time since the first logged op (s)", "rank")
    events = [e for d in dumps.values() for e in d.get("events", [])]
    t0 = min((e["start"] for e in events), default=0.0)
    ranks = range(world) if world else sorted(dumps)
    labels = {r: (_label(r, dumps[r]) if r in dumps else f"rank {r} (no dump: killed?)") for r in ranks}
    pending = []
    for axis in sorted({e["axis"] for e in events}):
        for done in (True, False):
            sel = [e for e in events if e["axis"] == axis and (e.get("end") is not None) == done]
            if not sel:
                continue
            ends = [(e["end"] if done else e["start"] + e.get("age_s", 0.0)) for e in sel]
            fig.add_bar(base=[e["start"] - t0 for e in sel],
                        x=[max(end - e["start"], 1e-3) for e, end in zip(sel, ends)],
                        y=[labels.get(e["rank"], f"rank {e['rank']}") for e in sel], orientation="h",
                        name=f"{axis} {'completed' if done else 'PENDING'}",
                        marker=_op_marker(axis, done),
                        text=[f"{e['op']} #{e['seq']}" for e in sel], cliponaxis=False,
                        textposition="inside" if done else "outside",
                        hovertemplate="%{y}<br>%{text}<br>from %{base:.3f} s for %{x:.3f} s<extra></extra>")
            if not done:
                pending += [(e["rank"], e["op"], e["axis"], e["seq"]) for e in sel]
    fig.update_yaxes(categoryorder="array", categoryarray=[labels[r] for r in reversed(list(ranks))],
                     type="category")
    for r in ranks:  # make rows of ranks without events (e.g. killed) appear
        if not any(e["rank"] == r for e in events):
            fig.add_scatter(x=[0], y=[labels[r]], mode="markers", marker=dict(symbol="x", size=12,
                            color="#222"), name=f"rank {r}: no ops logged", showlegend=True)
    right = max((e["start"] + (e.get("age_s") or 0.0) if e.get("end") is None else e["end"] for e in events),
                default=t0 + 1.0) - t0
    fig.update_xaxes(range=[0, 1.3 * right])  # room for the pending ops' labels right of their bars
    fig.update_layout(barmode="overlay", meta={"pending": sorted(pending)})
    return fig


def oom_figure(oom: dict, title: str = "Out of memory: what the rank held, and what it asked for"):
    """Bars from an OutOfMemory record (`dump['oom']`): 'measured + request' (the measured bytes
    with the failed request added to its category) and 'estimated', against the budget line."""
    measured = {c: float(oom["measured"].get(c, 0)) for c in CATEGORIES}
    measured[oom["category"]] += float(oom["requested"])
    bars = {"measured + request": measured}
    if oom.get("estimated"):
        bars["estimated (mini3d estimator)"] = {c: float(oom["estimated"].get(c, 0)) for c in CATEGORIES}
    fig = new_figure(title, "what the rank holds", "memory of the rank (MiB)")
    for c in CATEGORIES:  # MiB, not GiB: the drills run tiny models under tiny budgets
        fig.add_bar(x=list(bars), y=[b[c] / 2**20 for b in bars.values()], name=CATEGORY_LABELS[c],
                    marker_color=CATEGORY_COLORS[c])
    fig.update_layout(barmode="stack")
    fig.add_hline(y=oom["budget"] / 2**20, line=dict(color=CAPACITY_COLOR, dash="dash", width=2),
                  annotation_text=f"memory budget {oom['budget'] / 2**20:.1f} MiB",
                  annotation_position="top left")
    return fig


__all__ = ["PENDING_LOOK", "load_dumps", "hang_timeline_figure", "oom_figure"]
