"""Checks of the exercise explain_hang (chapter 08): per-rank event logs of a hung job, built so the
stuck collective and its missing rank are known.
"""

from __future__ import annotations

from mini3d.course.grading.core import Check, Exercise, expect


def _hang_logs(rng, tp, dp, stuck, steps, early=False):
    """Per-rank logs of `steps` rounds of (tp all_reduce, dp all_reduce); rank `stuck` stops before
    round `stuck_at`'s dp all-reduce, so its dp peers wait there. With tp > 1 and `early`
    (stuck_at < steps) the other dp groups finish that round and then wait in the next round's tp
    all-reduce, behind the blocked ranks: a later pending collective that is only a consequence."""
    from mini3d.grid import Grid

    grid = Grid(tp, 1, dp)
    stuck_at = rng.randint(1, steps - 1) if early else rng.randint(1, steps)
    logs = {r: [] for r in range(grid.world_size)}
    t = 0.0
    blocked = set()
    for s in range(1, steps + 1):
        for axis in ("tp", "dp"):
            for r in range(grid.world_size):
                if r in blocked:
                    continue
                if r == stuck and s == stuck_at and axis == "dp":
                    blocked.add(r)
                    continue
                group = tuple(grid.group_of(r, axis))
                t += 0.001
                logs[r].append({"axis": axis, "op": "all_reduce", "seq": s, "group": group,
                                "start": t, "end": None})
            for r in range(grid.world_size):  # completes when every member issued it
                for e in logs[r]:
                    if e["end"] is None and not (set(e["group"]) & blocked):
                        e["end"] = e["start"] + 0.0005
                if logs[r] and logs[r][-1]["end"] is None:
                    blocked.add(r)
    want_group = grid.group_of(stuck, "dp")
    return logs, {"axis": "dp", "op": "all_reduce", "seq": stuck_at,
                  "waiting": sorted(r for r in want_group if r != stuck), "missing": [stuck]}


def _cases(rng):
    """Three hung jobs: (tp, dp, logs, wanted answer). The first always has a second, later pending
    collective (tp = 2, stuck before the last round), so naming the last pending one, or every rank
    with anything pending, fails on every seed."""
    for case in range(3):
        tp, dp = (2 if case == 0 else rng.choice([1, 2])), rng.choice([2, 3, 4])
        logs, want = _hang_logs(rng, tp, dp, rng.randrange(tp * dp), rng.randint(2, 5), early=case == 0)
        yield tp, dp, logs, want


def finds_collective(ctx):
    for tp, dp, logs, want in _cases(ctx.rng):
        got = ctx.impl.explain_hang(logs) or {}
        sub = {k: got.get(k) for k in ("axis", "op", "seq")}
        expect(sub == {k: want[k] for k in sub}, f"stuck collective (tp={tp}, dp={dp})",
               {k: want[k] for k in sub}, sub)


def names_ranks(ctx):
    for tp, dp, logs, want in _cases(ctx.rng):
        got = ctx.impl.explain_hang(logs) or {}
        sub = {k: got.get(k) for k in ("waiting", "missing")}
        expect(sub == {k: want[k] for k in sub}, f"ranks in the hang (tp={tp}, dp={dp})",
               {k: want[k] for k in sub}, sub)


def no_hang(ctx):
    logs = {r: [{"axis": "dp", "op": "all_reduce", "seq": 1, "group": (0, 1), "start": 0.1 * r,
                 "end": 1.0}] for r in (0, 1)}
    got = ctx.impl.explain_hang(logs)
    expect(got is None, "explain_hang of logs with nothing pending", None, got)


EXERCISES = [
    Exercise("explain_hang", "08 debugging OOM and hangs", [
        Check("collective", 2, finds_collective, "names the stuck collective"),
        Check("ranks", 2, names_ranks, "names who waits and who never came"),
        Check("no_hang", 1, no_hang, "nothing pending: None"),
    ]),
]
