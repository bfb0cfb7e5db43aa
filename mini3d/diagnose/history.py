"""Evidence for `explain` that does not need every rank's dump: a rank's own error, a frozen rank,
and a rank whose step departs from its own previous step.

Why these exist. A member that gloo aborts on a size mismatch (SIGABRT) leaves no dump, and in a
group of two the op shapes alone cannot say which member was wrong. But every optimizer step issues
the same ops in the same order, so a rank that skipped a collective, or sent an odd shape, differs
from *its own* previous step: that comparison needs only the culprit's dump (or only a victim's).
"""

from __future__ import annotations

import re

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
        out.setdefault((e["axis"], e["op"], e.get("peer")), []).append((tuple(e["shape"]), ctx))
    return out


def self_divergence(run, r: int) -> tuple[str, str] | None:
    """(kind, text) when rank r's ops in its last step are not a prefix of its previous step's:
    "skip" when an op of the previous step is missing, "shape" when one has another shape."""
    d = run.dumps.get(r)
    if not d or not d.get("events"):
        return None
    events = d["events"]
    steps = sorted({(e.get("context") or {}).get("step") for e in events} - {None})
    if len(steps) < 2 or steps[-2] != steps[-1] - 1:
        return None
    cur, prev = steps[-1], steps[-2]
    before = _step_ops([e for e in events if (e.get("context") or {}).get("step") == prev], prev)
    now = _step_ops(events, cur)
    if steps[0] == prev and len(events) >= 256:  # the ring buffer may have cut the previous step
        return None
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
                return "shape", (f"rank {r} sent shape {shape} in its {op} #{i + 1} of step {cur} "
                                 f"({where}) on the {axis} group, where step {prev} had {ref[i][0]}")
            break
    return None


def diverging_rank(run, candidates) -> tuple[int, str, str] | None:
    """(rank, kind, text) of the first candidate that departs from its own previous step."""
    for r in candidates:
        found = self_divergence(run, r)
        if found:
            return (r, *found)
    return None


__all__ = ["VICTIM_ERRORS", "own_error", "process_state", "self_divergence", "diverging_rank"]
