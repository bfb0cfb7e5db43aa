"""Evidence for `explain` that does not need every rank's dump: a rank's own error, a frozen rank,
and a rank whose step departs from its own previous step.

Why these exist. A member that gloo aborts on a size mismatch (SIGABRT) leaves no dump, and in a
group of two the op shapes alone cannot say which member was wrong. But every optimizer step issues
the same ops in the same order, so a rank that skipped a collective, or sent an odd shape, differs
from *its own* previous step: that comparison needs only the culprit's dump (or only a victim's).
"""

from __future__ import annotations

import re
import signal

# Messages of a rank that failed because a peer did: it lost its connection, or the library
# noticed the peer's mismatch. A rank whose error is not one of these failed on its own.
VICTIM_ERRORS = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Read error|Write error|"
                           r"[Tt]imed? ?out|EnforceNotMet|doesn't match expected size|"
                           r"aborted by|NCCL communicator was aborted|ProcessGroup.*abort")


def own_error(run) -> int | None:
    """The first rank (in time) whose dump records an exception of its own (not a lost peer)."""
    mine = [(d.get("time", 0), r) for r, d in run.dumps.items()
            if d["status"] == "error" and not VICTIM_ERRORS.search(d.get("reason") or "")]
    return min(mine)[1] if mine else None


def process_state(run, r: int) -> str | None:
    """'stopped' (SIGSTOP / a debugger), 'running' (alive but silent) or None, as the launcher saw
    rank r when it recorded the job (launcher.json)."""
    return run.exits.get(r, {}).get("state")


def _step_ops(events: list[dict], step: int) -> dict[tuple, list]:
    """{(axis, op, peer): [(shape, context without step), ...]} of one step, in issue order."""
    out: dict[tuple, list] = {}
    for e in events:
        ctx = dict(e.get("context") or {})
        if ctx.pop("step", None) != step:
            continue
        out.setdefault((e["axis"], e["op"], e.get("peer")), []).append((_shape(e), ctx))
    return out


def _shape(e: dict):
    """An op's shape as the step-to-step comparison sees it: none for an all-to-all, whose row
    counts follow the routing and change every step by design."""
    return None if e["op"] == "all_to_all" else tuple(e["shape"])


def self_divergence(run, r: int) -> tuple[str, str] | None:
    """(kind, text) when rank r's ops in its last step are not a prefix of its previous step's:
    "skip" when an op of the previous step is missing, "shape" when one has another shape
    ("shape-p2p" for a send or recv). Compared per (axis, op, peer), then in issue order (a skip
    whose kind of op the rank never reached again in the step); a last step its black box saw
    end (the rank waits at the step's boundary) is whole, so an op missing at its end is a skip."""
    d = run.dumps.get(r)
    box = getattr(run, "issued", {}).get(r)  # its black box: both steps whole (a dump keeps 256)
    events = box or (d.get("events") if d else None)
    if not events:
        return None
    steps = sorted({(e.get("context") or {}).get("step") for e in events} - {None})
    if len(steps) < 2 or steps[-2] != steps[-1] - 1:
        return None
    cur, prev = steps[-1], steps[-2]
    if not box and steps[0] == prev and len(events) >= 256:  # the dump's ring may have cut it
        return None
    before = _step_ops([e for e in events if (e.get("context") or {}).get("step") == prev], prev)
    whole = box is not None and cur in getattr(run, "ended", {}).get(r, ())  # at its boundary
    found = (_per_key(r, before, _step_ops(events, cur), cur, prev)
             or _in_order(r, _flat(events, prev), _flat(events, cur), cur, prev, whole))
    if found or len(steps) < 3 or steps[-3] != prev - 1:
        return found
    return _in_order(r, _flat(events, prev - 1), _flat(events, prev), prev, prev - 1, whole=True)


def _per_key(r, before: dict, now: dict, cur: int, prev: int):
    for key, ops in now.items():
        ref = before.get(key, [])
        for i, (shape, ctx) in enumerate(ops):
            if i < len(ref) and ref[i] == (shape, ctx):
                continue
            axis, op, _ = key
            where = ", ".join(f"{k} {v}" for k, v in ctx.items())
            if i + 1 < len(ref) and ref[i + 1] == (shape, ctx):
                return "skip", (f"rank {r} skipped one {op} on the {axis} group in step {cur}: its "
                                f"{op} #{i + 1} of the step ({where}) is its #{i + 2} of step {prev}")
            if i < len(ref) and ref[i][1] == ctx:
                kind = "shape-p2p" if op in ("send", "recv") else "shape"
                return kind, (f"rank {r} sent shape {shape} in its {op} #{i + 1} of step {cur} "
                              f"({where}) on the {axis} group, where step {prev} had {ref[i][0]}")
            break
    return None


def _flat(events: list[dict], step: int) -> list[tuple]:
    """(axis, op, peer, shape, context without step) of one step's ops, in issue order."""
    out = []
    for e in events:
        ctx = dict(e.get("context") or {})
        if ctx.pop("step", None) == step:
            out.append((e["axis"], e["op"], e.get("peer"), _shape(e), tuple(ctx.items())))
    return out


def _in_order(r, before: list, now: list, cur: int, prev: int, whole: bool = False):
    """A skip in `now` against `before`, both in issue order; `whole`: `now` is a complete step,
    so an op of `before` missing at its end is a skip too."""
    if whole and len(now) < len(before) and before[:len(now)] == now:
        axis, name, _, _, ctx = before[len(now)]
        where = "".join(f" ({', '.join(f'{k} {v}' for k, v in ctx)})" for _ in ctx[:1])
        return "skip", (f"rank {r} skipped one {name} on the {axis} group in step {cur}: step "
                        f"{prev} ended with that {name}{where}, step {cur} ended without it")
    for i, op in enumerate(now):
        if i < len(before) and before[i] == op:
            continue
        if i + 1 < len(before) and before[i + 1] == op:
            axis, name, _, _, ctx = before[i]
            where = ", ".join(f"{k} {v}" for k, v in ctx)
            return "skip", (f"rank {r} skipped one {name} on the {axis} group in step {cur}: its op "
                            f"#{i + 1} of step {prev} was that {name} ({where}); in step {cur} its "
                            f"op #{i + 1} is the {op[1]} that followed it")
        return None
    return None


def diverging_rank(run, candidates) -> tuple[int, str, str] | None:
    """(rank, kind, text) of the first candidate that departs from its own previous step."""
    for r in candidates:
        found = self_divergence(run, r)
        if found:
            return (r, *found)
    return None


def diverged_behind_abort(run, dead: int):
    """A rank the library aborted (SIGABRT: gloo's size check) departed from its own previous step
    (its black box shows it skipped an op or changed a shape), or is a victim when a live rank's
    step departs from its own previous one: (rank, kind, text)."""
    if (run.exits.get(dead, {}).get("exitcode") != -signal.SIGABRT
            and "terminate called" not in run.stderr.get(dead, "")):
        return None
    return diverging_rank(run, [dead, *sorted(run.dumps)])  # the dead rank's black box first


def describe_op(ev: dict) -> str:
    """'all_reduce #41 on the dp group [1, 3] (step 2, mb 0)' from an event dict."""
    op = ev["op"]
    if op in ("send", "recv"):
        arrow = "to" if op == "send" else "from"
        s = f"{op} #{ev['seq']} {arrow} rank {ev['peer']} on the {ev['axis']} axis"
    else:
        s = f"{op} #{ev['seq']} on the {ev['axis']} group {list(ev['group'])}"
    s += f" shape {tuple(ev['shape'])}"
    ctx = ev.get("context") or {}
    if ctx:
        s += " (" + ", ".join(f"{k} {v}" for k, v in ctx.items()) + ")"
    return s

__all__ = ["describe_op", "VICTIM_ERRORS", "own_error", "process_state", "self_divergence", "diverging_rank",
           "diverged_behind_abort"]
