"""Wrong answers to the pipeline exercises (chapter 05): one_f_one_b, bubble, zb_h1."""

from __future__ import annotations

from solutions.bubble import simulate as _simulate
from solutions.one_f_one_b import one_f_one_b as _1f1b
from solutions.zb_h1 import zb_h1 as _zb

from . import variant


def _1f1b_warmup(pp, pp_rank, m, warmup):
    acts = [f"F{mb}" for mb in range(warmup)]
    for i in range(m - warmup):
        acts += [f"F{warmup + i}", f"B{i}"]
    return acts + [f"B{mb}" for mb in range(m - warmup, m)]


def warmup_one_more(pp, pp_rank, micro_batches):
    """The classic off-by-one: pp - pp_rank warm-up forwards instead of pp - pp_rank - 1."""
    return _1f1b_warmup(pp, pp_rank, micro_batches, min(pp - pp_rank, micro_batches))


def warmup_one_less(pp, pp_rank, micro_batches):
    return _1f1b_warmup(pp, pp_rank, micro_batches, max(min(pp - pp_rank - 2, micro_batches), 0))


def gpipe_order(pp, pp_rank, micro_batches):
    """Every forward, then every backward: GPipe, holding all m micro-batches."""
    return [f"F{i}" for i in range(micro_batches)] + [f"B{i}" for i in range(micro_batches)]


def closed_form(schedule, t_f, t_b):
    """The GPipe / 1F1B closed form from the lists' sizes, not a simulation of them."""
    pp, m = len(schedule), len(schedule[0]) // 2
    return {"makespan": (m + pp - 1) * (t_f + t_b), "bubble_fraction": (pp - 1) / (m + pp - 1)}


def idle_over_busy(schedule, t_f, t_b):
    """The right makespan, but the bubble as idle time over busy time, not over pp * makespan."""
    got = _simulate(schedule, t_f, t_b)
    busy = sum(t_f if a[0] == "F" else t_b for s in schedule for a in s)
    return {"makespan": got["makespan"], "bubble_fraction": (len(schedule) * got["makespan"] - busy) / busy}


def no_serial_wait(schedule, t_f, t_b):
    """Each action starts when its dependency finished, forgetting the rank is still busy."""
    pp, done, clock = len(schedule), {}, [0.0] * len(schedule)
    for _ in range(sum(map(len, schedule))):
        for r in range(pp):
            for a in schedule[r]:
                kind, mb = a[0], int(a[1:])
                dep = (("F", mb, r - 1) if kind == "F" and r > 0 else
                       ("B", mb, r + 1) if kind == "B" and r < pp - 1 else ("F", mb, r) if kind == "B" else None)
                if (kind, mb, r) not in done and (dep is None or dep in done):
                    done[(kind, mb, r)] = (done[dep] if dep else 0.0) + (t_f if kind == "F" else t_b)
                    clock[r] = max(clock[r], done[(kind, mb, r)])
    span = max(clock)
    busy = sum(t_f if a[0] == "F" else t_b for s in schedule for a in s)
    return {"makespan": span, "bubble_fraction": 1 - busy / (pp * span)}


def w_right_after_b(pp, pp_rank, micro_batches):
    """ZB-H1 without the deferral: each W straight after its B (1F1B with split backwards)."""
    return [a for x in _1f1b(pp, pp_rank, micro_batches) for a in ((x, "W" + x[1:]) if x[0] == "B" else (x,))]


def zb_warmup_one_more(pp, pp_rank, micro_batches):
    """ZB-H1 with 1F1B's off-by-one: one warm-up forward too many (the order of a pp + 1 pipeline)."""
    return _zb(pp + 1, pp_rank, micro_batches)


WRONG = {
    "one_f_one_b": [
        ("warmup_one_more", variant("one_f_one_b", "pp - pp_rank warm-up forwards", one_f_one_b=warmup_one_more)),
        ("warmup_one_less", variant("one_f_one_b", "pp - pp_rank - 2 warm-up forwards", one_f_one_b=warmup_one_less)),
        ("gpipe_order", variant("one_f_one_b", "all forwards, then all backwards", one_f_one_b=gpipe_order)),
    ],
    "bubble": [
        ("closed_form", variant("bubble", "the closed form instead of a simulation", simulate=closed_form)),
        ("idle_over_busy", variant("bubble", "bubble as idle / busy", simulate=idle_over_busy)),
        ("no_serial_wait", variant("bubble", "a rank runs several actions at once", simulate=no_serial_wait)),
    ],
    "zb_h1": [
        ("w_right_after_b", variant("zb_h1", "no W deferred", zb_h1=w_right_after_b)),
        ("warmup_one_more", variant("zb_h1", "pp - pp_rank warm-up forwards", zb_h1=zb_warmup_one_more)),
    ],
}
