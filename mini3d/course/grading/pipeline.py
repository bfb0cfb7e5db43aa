"""Checks of the exercises one_f_one_b and bubble (chapter 05, pipeline parallelism).

The ground truth is the 1F1B order written out by hand and the closed-form pipeline timings
(makespan (m + p - 1)(t_f + t_b), bubble (p - 1) / (m + p - 1)).
"""

from __future__ import annotations

from mini3d.pp.simulator import bubble_formula
from mini3d.schedule_kinds import schedule_kind

from mini3d.course.grading.core import Check, CheckFailed, Exercise, expect


def _ref_gpipe(pp, r, m):
    return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]


def _ref_1f1b(pp, r, m):
    w = min(pp - r - 1, m)
    out = [f"F{i}" for i in range(w)]
    for i in range(m - w):
        out += [f"F{w + i}", f"B{i}"]
    return out + [f"B{i}" for i in range(m - w, m)]


def _meshes(rng):
    """(pp, micro_batches) pairs, always including one deep pipeline with a long drain and one
    pipeline deeper than its micro-batch count (m < pp: some ranks never reach the steady state)."""
    deep, mid, short = rng.randint(4, 6), rng.randint(2, 5), rng.randint(2, 3)
    shallow = rng.randint(3, 5)
    return [(p, p + rng.randint(0, 4)) for p in (deep, mid, short)] + [(shallow, rng.randint(1, shallow - 1))]


def _each_mesh(ctx):
    for pp, m in _meshes(ctx.rng):
        yield pp, m, [list(ctx.impl.one_f_one_b(pp, r, m)) for r in range(pp)]


def _each_rank(ctx):
    for pp, m, lists in _each_mesh(ctx):
        for r, acts in enumerate(lists):
            yield pp, r, m, acts, lists


def _expect_order(ok, what, expected, got, pp, m, lists):
    """expect(), with mini3d's check() of the whole (pp, m) schedule under the message."""
    if not ok:
        from mini3d.course.grading.pipeline_report import schedule_report

        raise CheckFailed(f"{what}: expected {expected}, got {got}\n{schedule_report(pp, m, lists)}")


def fb_each_once(ctx):
    for pp, r, m, acts, _ in _each_rank(ctx):
        want = sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
        expect(sorted(acts) == want, f"pp={pp} rank {r} m={m}: each F and B exactly once",
               "F0..F%d and B0..B%d" % (m - 1, m - 1), acts)


def forward_first(ctx):
    for pp, r, m, acts, lists in _each_rank(ctx):
        for i in range(m):
            if f"F{i}" in acts and f"B{i}" in acts:
                _expect_order(acts.index(f"F{i}") < acts.index(f"B{i}"), f"pp={pp} rank {r} m={m}",
                              f"F{i} before B{i}", acts, pp, m, lists)


def warmup(ctx):
    for pp, r, m, acts, lists in _each_rank(ctx):
        lead = next((i for i, a in enumerate(acts) if a.startswith("B")), len(acts))
        _expect_order(lead == min(pp - r, m), f"pp={pp} rank {r} m={m}: forwards before the first backward "
                      f"(the pp - pp_rank - 1 warm-up forwards and the steady state's first)",
                      min(pp - r, m), f"{lead} in {acts}", pp, m, lists)


def in_flight(ctx):
    for pp, r, m, acts, lists in _each_rank(ctx):
        live = peak = 0
        for a in acts:
            live += 1 if a.startswith("F") else -1
            peak = max(peak, live)
        _expect_order(peak <= min(pp - r, m), f"pp={pp} rank {r} m={m}: micro-batches held at once",
                      f"at most {min(pp - r, m)}", f"{peak} in {acts}", pp, m, lists)


def exact_order(ctx):
    for pp, r, m, acts, lists in _each_rank(ctx):
        want = _ref_1f1b(pp, r, m)
        step = next((k for k, (a, b) in enumerate(zip(acts, want)) if a != b), min(len(acts), len(want)))
        _expect_order(acts == want, f"pp={pp} rank {r} m={m}: 1F1B order", want,
                      f"{acts} (first difference at step {step}: expected "
                      f"{want[step] if step < len(want) else 'the end'}, got {acts[step] if step < len(acts) else 'the end'})",
                      pp, m, lists)


def _sim(ctx, sched, tf, tb):
    got = ctx.impl.simulate(sched, tf, tb)
    expect(isinstance(got, dict) and {"makespan", "bubble_fraction"} <= set(got),
           "simulate(...) result", "a dict with makespan and bubble_fraction", got)
    return got


def _close(a, b):
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def _formula(ctx, kind, ref):
    """`kind`'s makespan and bubble on the learner's simulator, fed `ref(pp, r, m)`'s orders."""
    for _ in range(3):
        pp, m = ctx.rng.randint(2, 6), ctx.rng.randint(1, 9)
        m = max(m, schedule_kind(kind).min_microbatches(pp))
        tf, tb = ctx.rng.randint(1, 5) * 0.5, ctx.rng.randint(1, 5) * 0.5
        sched = [ref(pp, r, m) for r in range(pp)]
        got = _sim(ctx, sched, tf, tb)
        span = (m + pp - 1) * (tf + tb)
        expect(_close(got["makespan"], span), f"{kind} pp={pp} m={m} t_f={tf} t_b={tb}: makespan",
               f"(m + pp - 1)(t_f + t_b) = {span}", got["makespan"])
        bub = float(bubble_formula(kind, pp, m))
        expect(_close(got["bubble_fraction"], bub), f"{kind} pp={pp} m={m}: bubble_fraction",
               f"(pp - 1) / (m + pp - 1) = {bub:.6f}", got["bubble_fraction"])


def gpipe_formula(ctx):
    _formula(ctx, "gpipe", _ref_gpipe)


def one_f_one_b_formula(ctx):
    _formula(ctx, "1f1b", _ref_1f1b)


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
    _serial(ctx, tf, tb)


def _serial(ctx, tf, tb):
    """Every rank runs F0 B0 F1 B1 ...: one micro-batch in the pipe at a time, so each waits for the
    previous one's whole forward and backward chain: makespan m * pp * (t_f + t_b), bubble 1 - 1/pp.
    No closed form for GPipe / 1F1B gives this: only a simulation of the lists does."""
    pp, m = ctx.rng.randint(2, 5), ctx.rng.randint(2, 5)
    sched = [[a for i in range(m) for a in (f"F{i}", f"B{i}")] for _ in range(pp)]
    got = _sim(ctx, sched, tf, tb)
    span = m * pp * (tf + tb)
    expect(_close(got["makespan"], span), f"makespan of one-at-a-time lists F0 B0 F1 B1 ... (pp={pp}, "
           f"m={m}, t_f={tf}, t_b={tb}; simulate the lists, not a formula)", f"m * pp * (t_f + t_b) = {span}",
           got["makespan"])
    expect(_close(got["bubble_fraction"], 1 - 1 / pp), f"bubble_fraction of those lists (pp={pp})",
           f"1 - 1/pp = {1 - 1 / pp:.6f}", got["bubble_fraction"])


EXERCISES = [
    Exercise("one_f_one_b", "05 pipeline parallelism", [
        Check("each_once", 2, fb_each_once, "every micro-batch forward and backward once"),
        Check("forward_first", 1, forward_first, "F(mb) before B(mb)"),
        Check("warmup", 2, warmup, "1F1B's number of forwards before the first backward"),
        Check("in_flight", 2, in_flight, "no more micro-batches held than 1F1B holds"),
        Check("exact_order", 3, exact_order, "the exact 1F1B order"),
    ]),
    Exercise("bubble", "05 pipeline parallelism", [
        Check("gpipe", 2, gpipe_formula, "GPipe: (m+p-1)(tf+tb), bubble (p-1)/(m+p-1)"),
        Check("one_f_one_b", 2, one_f_one_b_formula, "1F1B has the same bubble as GPipe"),
        Check("dependencies", 1, waits_for_neighbours, "hand-timed lists no formula describes"),
    ]),
]
