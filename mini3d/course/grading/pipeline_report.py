"""What mini3d's own `check()` says of a learner's 1F1B lists: shown under every failed order check.

The learner writes compute orders only ("F3", "B3" per rank). To let `mini3d.pp.rules.check` judge
them, they become a `Schedule` of one stage per rank: when the compute order can run at all, the
transfers are placed by `mini3d.pp.schedules.add_transfers` (as for mini3d's own schedules), and
`check()` reports the broken rules, e.g. more micro-batches in flight than 1F1B allows. When it
cannot run (a backward before the forward it needs, on some rank), each receive is put right before
the compute that needs it and each send right after the compute that produced it, and `check()`'s
blocking send/recv simulation names the deadlock: which rank, at which step, waits for what.
"""

from __future__ import annotations


def _as_orders(lists):
    """Per-rank 'F3' / 'B3' strings -> mini3d Actions of stage r (one stage per rank: v = 1)."""
    from mini3d.pp.schedules import Action

    return [[Action(a[0], r, int(a[1:])) for a in acts] for r, acts in enumerate(lists)]


def _naive_transfers(pp, m, orders, bounds):
    """The placement a hand-written loop makes: receive just before use, send just after."""
    from mini3d.pp.schedules import Action, Schedule

    actions = []
    for r, order in enumerate(orders):
        acts = []
        for a in order:
            if a.op == "F" and r > 0:
                acts.append(Action("RECV_F", r, a.mb, r - 1))
            if a.op == "B" and r < pp - 1:
                acts.append(Action("RECV_B", r, a.mb, r + 1))
            acts.append(a)
            if a.op == "F" and r < pp - 1:
                acts.append(Action("SEND_F", r, a.mb, r + 1))
            if a.op == "B" and r > 0:
                acts.append(Action("SEND_B", r, a.mb, r - 1))
        actions.append(tuple(acts))
    return Schedule("1f1b", pp, m, 1, tuple(actions), bounds)


def schedule_report(pp: int, m: int, lists) -> str:
    """check()'s verdict on the learner's lists for (pp, m), with the schedule as a grid."""
    from mini3d.pp.rules import check
    from mini3d.pp.schedules import add_transfers
    from mini3d.pp.simulator import Stuck

    try:
        orders = _as_orders(lists)
    except (ValueError, IndexError, TypeError):
        return "(mini3d's check() reads actions written 'F<micro-batch>' or 'B<micro-batch>')"
    bounds = tuple(min(pp - r, m) for r in range(pp))
    try:
        sched, runs = add_transfers("1f1b", pp, m, 1, orders, bounds), True
    except Stuck:
        sched, runs = _naive_transfers(pp, m, orders, bounds), False
    verdict = str(check(sched)).replace("\n", "\n  ")
    if runs:
        grid = sched.format_grid()
    else:  # each rank's first actions with their transfers: the deadlock is near the start
        grid = "\n".join([f"your lists with receive-before-use, send-after-compute (first {_SHOWN} actions):"] + [
            f"rank {r}: " + " ".join(str(a) for a in acts[:_SHOWN]) + (" ..." if len(acts) > _SHOWN else "")
            for r, acts in enumerate(sched.actions)])
    return f"mini3d's check() of your lists for pp={pp}, m={m}: {verdict}\n  " + grid.replace("\n", "\n  ")


_SHOWN = 12


__all__ = ["schedule_report"]
