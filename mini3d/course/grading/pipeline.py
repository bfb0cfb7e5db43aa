"""Checks of the exercises one_f_one_b and bubble (chapter 05, pipeline parallelism).

The ground truth is the 1F1B order written out by hand and the closed-form pipeline timings
(makespan (m + p - 1)(t_f + t_b), bubble (p - 1) / (m + p - 1)).
"""

from __future__ import annotations

from .core import Check, Exercise, expect


def _ref_1f1b(pp, r, m):
    w = min(pp - r - 1, m)
    out = [f"F{i}" for i in range(w)]
    for i in range(m - w):
        out += [f"F{w + i}", f"B{i}"]
    return out + [f"B{i}" for i in range(m - w, m)]


def _meshes(rng):
    """(pp, micro_batches) pairs, always including one deep pipeline with a long drain."""
    pairs = [(rng.randint(4, 6), 0), (rng.randint(2, 5), 0), (rng.randint(2, 3), 0)]
    return [(p, p + rng.randint(0, 4)) for p, _ in pairs]


def _each_rank(ctx):
    for pp, m in _meshes(ctx.rng):
        for r in range(pp):
            yield pp, r, m, list(ctx.impl.one_f_one_b(pp, r, m))


def fb_each_once(ctx):
    for pp, r, m, acts in _each_rank(ctx):
        want = sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
        expect(sorted(acts) == want, f"pp={pp} rank {r} m={m}: each F and B exactly once",
               "F0..F%d and B0..B%d" % (m - 1, m - 1), acts)


def forward_first(ctx):
    for pp, r, m, acts in _each_rank(ctx):
        for i in range(m):
            if f"F{i}" in acts and f"B{i}" in acts:
                expect(acts.index(f"F{i}") < acts.index(f"B{i}"), f"pp={pp} rank {r} m={m}",
                       f"F{i} before B{i}", acts)


def warmup(ctx):
    for pp, r, m, acts in _each_rank(ctx):
        lead = next((i for i, a in enumerate(acts) if a.startswith("B")), len(acts))
        expect(lead == min(pp - r, m), f"pp={pp} rank {r} m={m}: forwards before the first backward",
               min(pp - r, m), f"{lead} in {acts}")


def in_flight(ctx):
    for pp, r, m, acts in _each_rank(ctx):
        live = peak = 0
        for a in acts:
            live += 1 if a.startswith("F") else -1
            peak = max(peak, live)
        expect(peak <= min(pp - r, m), f"pp={pp} rank {r} m={m}: micro-batches held at once",
               f"at most {min(pp - r, m)}", f"{peak} in {acts}")


def exact_order(ctx):
    for pp, r, m, acts in _each_rank(ctx):
        want = _ref_1f1b(pp, r, m)
        expect(acts == want, f"pp={pp} rank {r} m={m}: 1F1B order", want, acts)




def _sim(ctx, sched, tf, tb):
    got = ctx.impl.simulate(sched, tf, tb)
    expect(isinstance(got, dict) and {"makespan", "bubble_fraction"} <= set(got),
           "simulate(...) result", "a dict with makespan and bubble_fraction", got)
    return got


def _close(a, b):
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def _formula(ctx, kind):
    for _ in range(3):
        pp, m = ctx.rng.randint(2, 6), ctx.rng.randint(1, 9)
        m = max(m, pp) if kind == "1f1b" else m
        tf, tb = ctx.rng.randint(1, 5) * 0.5, ctx.rng.randint(1, 5) * 0.5
        sched = ([[f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)] for _ in range(pp)]
                 if kind == "gpipe" else [_ref_1f1b(pp, r, m) for r in range(pp)])
        got = _sim(ctx, sched, tf, tb)
        span = (m + pp - 1) * (tf + tb)
        expect(_close(got["makespan"], span), f"{kind} pp={pp} m={m} t_f={tf} t_b={tb}: makespan",
               f"(m + pp - 1)(t_f + t_b) = {span}", got["makespan"])
        bub = (pp - 1) / (m + pp - 1)
        expect(_close(got["bubble_fraction"], bub), f"{kind} pp={pp} m={m}: bubble_fraction",
               f"(pp - 1) / (m + pp - 1) = {bub:.6f}", got["bubble_fraction"])


def gpipe_formula(ctx):
    _formula(ctx, "gpipe")


def one_f_one_b_formula(ctx):
    _formula(ctx, "1f1b")


def waits_for_neighbours(ctx):
    """A 2-stage pipeline, worked by hand: the last stage runs B0 only after its own F0 and F1 (its
    list says so), and rank 0's B0 waits for rank 1's B0."""
    tf, tb = 1.0, ctx.rng.choice([2.0, 3.0])
    sched = [["F0", "F1", "B0", "B1"], ["F0", "F1", "B0", "B1"]]
    # rank1: F0 1-2, F1 2-3, B0 3-3+tb, B1 ..3+2tb; rank0: B0 starts at 3+tb, B1 at max(3+2tb, 3+2tb)
    span = 3 + 3 * tb
    got = _sim(ctx, sched, tf, tb)
    expect(_close(got["makespan"], span), f"makespan of {sched} with t_f={tf}, t_b={tb}", span,
           got["makespan"])


EXERCISES = [
    Exercise("one_f_one_b", "05 pipeline parallelism", [
        Check("each_once", 2, fb_each_once, "every micro-batch forward and backward once"),
        Check("forward_first", 1, forward_first, "F(mb) before B(mb)"),
        Check("warmup", 2, warmup, "pp - pp_rank forwards before the first backward"),
        Check("in_flight", 2, in_flight, "at most pp - pp_rank micro-batches held"),
        Check("exact_order", 3, exact_order, "the exact 1F1B order"),
    ]),
    Exercise("bubble", "05 pipeline parallelism", [
        Check("gpipe", 2, gpipe_formula, "GPipe: (m+p-1)(tf+tb), bubble (p-1)/(m+p-1)"),
        Check("one_f_one_b", 2, one_f_one_b_formula, "1F1B has the same bubble as GPipe"),
        Check("dependencies", 1, waits_for_neighbours, "a hand-timed 2-stage case"),
    ]),
]
