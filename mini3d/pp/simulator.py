"""Timing a schedule: when would each action start and end, and how much of the pipeline idles?

The simulator walks the same `Schedule` the runtime executes. Each rank runs its compute actions in
its own order, one at a time; an action starts when its rank is free and its input exists:

    F(s, mb) needs F(s-1, mb) done   (+ t_p2p when s-1 lives on another rank)
    B(s, mb) needs B(s+1, mb) done   (+ t_p2p likewise); B(last, mb) needs F(last, mb)
    W(s, mb) needs B(s, mb) done     (same rank)

`t_bwd` is always the cost of a whole backward. In a split schedule (one with W actions) B costs
t_bwd - t_w (the input gradient) and W costs t_w (the weight gradients); t_w defaults to t_bwd / 2
(one matmul for each of the two gradients of every forward matmul).

Transfers are modelled as a latency `t_p2p` on the edge that does not occupy either rank (the sends
and receives of a real run overlap with compute, or are tiny next to it on CPU). Costs are per
*stage*, i.e. per model chunk: for the interleaved schedule with v chunks per rank, pass t / v.
Arithmetic is generic, so `fractions.Fraction` costs give exact bubble fractions.

For uniform costs the result is the textbook closed form (`bubble_formula`):
GPipe and 1F1B (p-1)/(m+p-1); interleaved 1F1B (p-1)/(v m+p-1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from mini3d.schedule_kinds import schedule_kind
from mini3d.pp.placement import stage_rank


class Stuck(RuntimeError):
    """The compute orders cannot run: some rank waits for an input that never comes."""


def _per_stage(t, n_stages: int, name: str) -> list:
    if isinstance(t, (list, tuple)):
        if len(t) != n_stages:
            raise ValueError(f"{name} has {len(t)} entries for {n_stages} stages")
        return list(t)
    return [t] * n_stages


def _costs(orders, n_stages: int, t_fwd, t_bwd, t_w) -> dict:
    """{op: per-stage cost list}; B is the input-gradient part when the orders have W actions."""
    tf, tb = _per_stage(t_fwd, n_stages, "t_fwd"), _per_stage(t_bwd, n_stages, "t_bwd")
    if not any(a.op == "W" for order in orders for a in order):
        return {"F": tf, "B": tb, "W": tb}
    tw = [b * Fraction(1, 2) for b in tb] if t_w is None else _per_stage(t_w, n_stages, "t_w")
    return {"F": tf, "B": [b - w for b, w in zip(tb, tw)], "W": tw}


def _dependency(a, n_stages: int):
    if a.op == "F":
        return ("F", a.stage - 1, a.mb) if a.stage > 0 else None
    if a.op == "W":
        return ("B", a.stage, a.mb)
    return ("F", a.stage, a.mb) if a.stage == n_stages - 1 else ("B", a.stage + 1, a.mb)


def time_compute(orders, p: int, n_stages: int, t_fwd, t_bwd, t_p2p=0, t_w=None,
                 placement: str = "loop") -> list[list[tuple]]:
    """(start, end) of every compute action in `orders` (per-rank lists of F/B/W Actions)."""
    cost = _costs(orders, n_stages, t_fwd, t_bwd, t_w)
    done: dict[tuple, object] = {}  # (op, stage, mb) -> end time
    times = [[] for _ in orders]
    pos, free = [0] * len(orders), [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progress = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                dep = _dependency(a, n_stages)
                if dep is not None and dep not in done:
                    break
                ready = 0 if dep is None else done[dep]
                if t_p2p and dep is not None and \
                        stage_rank(dep[1], p, placement) != stage_rank(a.stage, p, placement):
                    ready = ready + t_p2p  # (skipped when 0, so Fraction costs stay exact)
                start = max(free[r], ready)
                free[r] = start + cost[a.op][a.stage]
                done[(a.op, a.stage, a.mb)] = free[r]
                times[r].append((start, free[r]))
                pos[r] += 1
                remaining -= 1
                progress = True
        if not progress:
            waits = [f"rank {r} step {pos[r]} ({orders[r][pos[r]]})"
                     for r in range(len(orders)) if pos[r] < len(orders[r])]
            raise Stuck("compute order cannot proceed; blocked: " + ", ".join(waits))
    return times


@dataclass
class SimResult:
    """Simulated step: per-rank timeline [(start, end, action)], makespan and bubble fraction."""

    timeline: list = field(default_factory=list)
    makespan: float = 0.0
    bubble_fraction: float = 0.0
    busy: list = field(default_factory=list)  # compute time per rank

    def to_dict(self) -> dict:
        return {"makespan": float(self.makespan), "bubble_fraction": float(self.bubble_fraction),
                "busy": [float(b) for b in self.busy],
                "timeline": [[(float(s), float(e), str(a)) for s, e, a in row]
                             for row in self.timeline]}


def simulate(schedule, t_fwd, t_bwd, t_p2p=0.0, t_w=None) -> SimResult:
    """Time `schedule` with per-stage forward / whole-backward costs (scalars or lists of n_stages)
    and, for split schedules, the weight-gradient share `t_w` of each backward."""
    p = schedule.p
    orders = [schedule.compute(r) for r in range(p)]
    times = time_compute(orders, p, schedule.n_stages, t_fwd, t_bwd, t_p2p, t_w,
                         getattr(schedule, "placement", "loop"))
    timeline = [[(s, e, a) for (s, e), a in zip(times[r], orders[r])] for r in range(p)]
    makespan = max((e for row in times for _, e in row), default=0)
    busy = [sum((e - s for s, e in row), 0) for row in times]
    return SimResult(timeline, makespan, bubble_of(times, makespan), busy)


def idle_gaps(busy, makespan=None, eps=0) -> list[list[tuple]]:
    """Per rank, the (start, end) intervals between 0 and the makespan in which it computes nothing.
    `busy[r]` holds rank r's compute intervals (start, end), in any order, overlaps allowed (a
    measured timeline's); gaps of at most `eps` are not counted."""
    if makespan is None:
        makespan = max((e for row in busy for _, e in row), default=0)
    gaps = []
    for row in busy:
        out, t = [], 0
        for s, e in sorted(row):
            if s > t + eps:
                out.append((t, s))
            t = max(t, e)
        if makespan > t + eps:
            out.append((t, makespan))
        gaps.append(out)
    return gaps


def bubble_of(busy, makespan=None, eps=0):
    """The bubble fraction of a timeline: its idle share of p x makespan (`idle_gaps`; exact for
    Fraction times). What `simulate` reports, and what the course measures on a real run."""
    if makespan is None:
        makespan = max((e for row in busy for _, e in row), default=0)
    if not makespan:
        return 0
    idle = sum((e - s for row in idle_gaps(busy, makespan, eps) for s, e in row), 0)
    return idle / (len(busy) * makespan)


def bubble_formula(kind: str, p: int, m: int, v: int = 1, t_fwd=1, t_bwd=2, t_w=None):
    """Closed-form bubble fraction, or None where there is none (zbv: simulate it): the registry's
    `ScheduleKind.bubble` (mini3d/schedule_kinds.py). GPipe, 1F1B: (p-1)/(m+p-1); interleaved and
    looped BFS: (p-1)/(v m+p-1); ZB-H1: (p-1)(t_F+t_B-t_W) / (m(t_F+t_bwd) + (p-1)(t_F+t_B-t_W))."""
    return schedule_kind(kind).bubble(p, m, v, t_fwd, t_bwd, t_w)


__all__ = ["simulate", "SimResult", "bubble_formula", "bubble_of", "idle_gaps", "time_compute", "Stuck"]
