"""How much communication was hidden behind compute, measured from a rank's event log and timeline.

Definitions (one rank, one optimizer step):

* compute intervals: the rank's forward, backward and weight-gradient actions, as its timeline
  records them (`StepResult.timeline` of the pipeline runtime; `Trainer.last_timeline` when
  pp = 1), merged where they touch. The clock (`mini3d.timeline_clock`): perf_counter seconds on
  CPU; on CUDA the GPU's times (timing events, resolved at the step's read-back, on the host's
  seconds scale), not the host's launch times. They include the tp collectives issued inside a
  layer: a rank blocked in one of those is inside its action, so tp time counts as compute here;
* an op's in-flight interval: [issue, completion] from the event log's snapshot (`start` / `end`
  of `comm_log.Event.as_dict`). On CPU the host's perf_counter: for an asynchronous op the log
  records the completion when the host first learns of it (the wait, or the next op's check of
  pending Works), so the interval can run past the moment the transfer really finished, into the
  rank's next compute or wait: the exposed part below is exact (the rank was not computing and
  the op was not known to be done), the hidden part an upper bound by at most the time between
  completion and that check. On CUDA with NCCL the GPU's: from a timing event on the compute
  stream before the issue to the op's completion on the GPU (a mark on a side stream that waits
  for it), on the timeline's scale, so both bounds are the GPU's;
* hidden seconds of an op = |in-flight interval ∩ compute intervals|; exposed = in-flight - hidden;
* hidden fraction of a set of ops = their hidden seconds summed / their in-flight seconds summed
  (0 when they were never in flight).

The sets: "dp", the data-parallel gradient sync (every all-reduce, reduce-scatter and all-gather
on the dp or dp_cp axis except one-element tensors, the loss average for the log), and "pp", the
pipeline's sends and receives (a blocking receive is all exposed: the rank waits in it). The cost
model's assumption for the same run is `model_overlap`: the dp sync hides behind the last
backward except its exposed part (`breakdown["dp_exposed"]` of `dp_total`), and every p2p message
it counts lies on the critical path (hidden fraction 0).
"""

from __future__ import annotations

from typing import Iterable, Sequence

COMPUTE_OPS = ("F", "B", "W")
DP_AXES = ("dp", "dp_cp")
DP_OPS = ("all_reduce", "reduce_scatter", "all_gather")
PP_OPS = ("send", "recv")


def compute_intervals(timeline: Sequence[Sequence]) -> list[tuple[float, float]]:
    """The F / B / W actions of a timeline [(start, end, action), ...] as sorted, merged intervals."""
    spans = sorted((s, e) for s, e, a in timeline if str(a)[:1] in COMPUTE_OPS and e > s)
    merged: list[tuple[float, float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def hidden_seconds(start: float, end: float, compute: Sequence[tuple[float, float]]) -> float:
    """Length of [start, end] ∩ the union of the (merged) compute intervals."""
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in compute)


def is_dp_sync(ev: dict) -> bool:
    return ev["axis"] in DP_AXES and ev["op"] in DP_OPS and _numel(ev["shape"]) > 1


def is_pp_p2p(ev: dict) -> bool:
    return ev["axis"] == "pp" and ev["op"] in PP_OPS


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def overlap_of(events: Iterable[dict], compute: Sequence[tuple[float, float]]) -> dict:
    """{"n", "in_flight_s", "hidden_s", "exposed_s", "fraction"} over `events` (completed ones)."""
    n, total, hidden = 0, 0.0, 0.0
    for ev in events:
        if ev.get("end") is None:
            continue
        n += 1
        total += ev["end"] - ev["start"]
        hidden += hidden_seconds(ev["start"], ev["end"], compute)
    return {"n": n, "in_flight_s": total, "hidden_s": hidden, "exposed_s": total - hidden,
            "fraction": hidden / total if total > 0 else 0.0}


def measured_overlap(events: Sequence[dict], timeline: Sequence[Sequence],
                     step: int | None = None) -> dict:
    """{"dp": overlap_of(dp sync), "pp": overlap_of(p2p)} on one rank for one step: `events` are
    its event log (`CommLog.snapshot()`, `collect=["events"]`), `timeline` that step's actions
    (`collect=["timeline"]`, the last step); `step` (0-based, as the log's context has it)
    selects the step's events, default the latest step in the log."""
    if step is None:
        step = max((ev["context"].get("step", -1) for ev in events), default=-1)
    mine = [ev for ev in events if ev["context"].get("step") == step]
    compute = compute_intervals(timeline)
    return {"dp": overlap_of([e for e in mine if is_dp_sync(e)], compute),
            "pp": overlap_of([e for e in mine if is_pp_p2p(e)], compute)}


def run_overlap(results: Sequence[dict]) -> dict:
    """Over every rank of a launched `train_worker` run with collect=["events", "timeline"]:
    {"dp": ..., "pp": ...} with the in-flight and hidden seconds summed over the ranks (so the
    fraction weighs each rank by its communication time) and "per_rank" [measured_overlap]."""
    per_rank = [measured_overlap(r["events"], r.get("timeline") or []) for r in results]
    out = {"per_rank": per_rank}
    for kind in ("dp", "pp"):
        total = sum(p[kind]["in_flight_s"] for p in per_rank)
        hidden = sum(p[kind]["hidden_s"] for p in per_rank)
        out[kind] = {"n": sum(p[kind]["n"] for p in per_rank), "in_flight_s": total,
                     "hidden_s": hidden, "exposed_s": total - hidden,
                     "fraction": hidden / total if total > 0 else 0.0}
    return out


def model_overlap(cfg, plan, hw) -> dict:
    """The cost model's hidden fractions for `plan` (see above): {"dp": 1 - dp_exposed /
    dp_total (None without dp traffic), "pp": 0.0 (None when pp = 1)}."""
    from mini3d.cost.model import estimate_cost

    b = estimate_cost(cfg, plan, hw).breakdown
    dp = 1 - b["dp_exposed"] / b["dp_total"] if b["dp_total"] > 0 else None
    return {"dp": dp, "pp": 0.0 if plan.pp > 1 else None}


__all__ = ["compute_intervals", "hidden_seconds", "overlap_of", "measured_overlap", "run_overlap",
           "model_overlap", "is_dp_sync", "is_pp_p2p"]
