"""Checks of the exercise zb_h1 (chapter 05, pipeline parallelism): ZB-H1's per-rank action lists.

The ground truth is mini3d's own engine: the learner's lists become a `mini3d.pp.Schedule`
(transfers added by `add_transfers`), which `check()` must pass (rules, B before W, no deadlock,
1F1B's memory: at most pp micro-batches alive per rank), whose simulated bubble with
t_F = t_B = t_W = 1 must be ZB-H1's closed form (p-1)/(3m+p-1), below 1F1B's (p-1)/(m+p-1), and
whose order must be Qi et al.'s (`mini3d.pp.schedules.zb_h1`, equal to PyTorch's order).
"""

from __future__ import annotations

from mini3d.course.grading.core import Check, Exercise, expect


def _meshes(rng):
    """(pp, micro_batches): a deep pipeline (several deferred W to drain) and two smaller ones."""
    return [(p, p + rng.randint(0, 4)) for p in (rng.randint(4, 6), rng.randint(2, 5), 3)]


def _lists(ctx, pp, m):
    return [list(ctx.impl.zb_h1(pp, r, m)) for r in range(pp)]


def _schedule(pp, m, lists):
    """The learner's lists as a mini3d Schedule (stage = rank), or raise CheckFailed."""
    from mini3d.pp.schedules import Action, add_transfers
    from mini3d.pp.simulator import Stuck

    orders = []
    for r, acts in enumerate(lists):
        order = []
        for a in acts:
            expect(isinstance(a, str) and len(a) > 1 and a[0] in "FBW" and a[1:].isdigit(),
                   f"pp={pp} rank {r} m={m}: an action", "'F3', 'B3' or 'W3'", a)
            order.append(Action(a[0], r, int(a[1:])))
        orders.append(order)
    try:
        return add_transfers("zb-h1", pp, m, 1, orders, tuple(min(pp, m) for _ in range(pp)))
    except Stuck as e:
        expect(False, f"pp={pp} m={m}: the lists can run", "every action's input to arrive", e)


def each_once(ctx):
    for pp, m in _meshes(ctx.rng):
        for r, acts in enumerate(_lists(ctx, pp, m)):
            want = sorted(f"{op}{i}" for op in "FBW" for i in range(m))
            expect(sorted(acts) == want, f"pp={pp} rank {r} m={m}: each F, B and W exactly once",
                   f"F, B and W of micro-batches 0..{m - 1}", acts)


def b_before_w(ctx):
    for pp, m in _meshes(ctx.rng):
        for r, acts in enumerate(_lists(ctx, pp, m)):
            for i in range(m):
                pos = [acts.index(f"{op}{i}") if f"{op}{i}" in acts else -1 for op in "FBW"]
                expect(pos[0] < pos[1] < pos[2], f"pp={pp} rank {r} m={m}: micro-batch {i}",
                       f"F{i} before B{i} before W{i}", acts)


def checker_passes(ctx):
    from mini3d.pp.rules import check

    for pp, m in _meshes(ctx.rng):
        res = check(_schedule(pp, m, _lists(ctx, pp, m)))
        expect(res.ok, f"pp={pp} m={m}: mini3d's check() (rules, deadlock, at most pp alive)",
               "OK", str(res))


def bubble(ctx):
    from fractions import Fraction

    from mini3d.pp.simulator import bubble_formula, simulate

    for pp, m in _meshes(ctx.rng):
        sched = _schedule(pp, m, _lists(ctx, pp, m))
        got = simulate(sched, Fraction(1), Fraction(2), t_w=Fraction(1)).bubble_fraction
        want = bubble_formula("zb-h1", pp, m)
        expect(got == want, f"pp={pp} m={m}: simulated bubble with t_F = t_B = t_W = 1",
               f"(p-1)/(3m+p-1) = {want} (1F1B: {bubble_formula('1f1b', pp, m)})", got)


def exact_order(ctx):
    from mini3d.pp.schedules import zb_h1

    for pp, m in _meshes(ctx.rng):
        ref = zb_h1(pp, m)
        for r, acts in enumerate(_lists(ctx, pp, m)):
            want = [f"{a.op}{a.mb}" for a in ref.compute(r)]
            expect(acts == want, f"pp={pp} rank {r} m={m}: the ZB-H1 order", want, acts)


EXERCISES = [
    Exercise("zb_h1", "05 pipeline parallelism", [
        Check("each_once", 2, each_once, "every micro-batch's F, B and W once"),
        Check("b_before_w", 1, b_before_w, "F before B before W"),
        Check("checker", 2, checker_passes, "check() passes: no deadlock, at most pp alive"),
        Check("bubble", 2, bubble, "simulated bubble (p-1)/(3m+p-1), below 1F1B's"),
        Check("exact_order", 3, exact_order, "the exact ZB-H1 order"),
    ]),
]
