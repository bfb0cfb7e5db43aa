"""Exercise explain_hang: which collective is stuck, and which ranks never joined it?

Chapter: 08 debugging OOM and hangs (course/08_debugging_oom_and_hangs.ipynb)
"""

from __future__ import annotations


def explain_hang(logs: dict) -> dict | None:
    """Explain a hang from per-rank communication logs.

    `logs[rank]` lists that rank's events (dicts with "axis", "op", "seq", "group", "start" and
    "end"; "end" is None while the op is still pending). A collective completes only when every
    member of its group has issued it (same axis, op and seq). Find the pending collective that was
    issued first (smallest "start"), and return {"axis", "op", "seq", "waiting": sorted ranks with
    it pending, "missing": sorted members of its group that never issued it}. No pending event:
    return None."""
    pending = [e for evs in logs.values() for e in evs if e["end"] is None]
    if not pending:
        return None
    first = min(pending, key=lambda e: e["start"])
    key = (first["axis"], first["op"], first["seq"])
    group = set(first["group"])
    issued = {r for r in group if any((e["axis"], e["op"], e["seq"]) == key for e in logs.get(r, []))}
    waiting = {r for r in group
               if any((e["axis"], e["op"], e["seq"]) == key and e["end"] is None
                      for e in logs.get(r, []))}
    return {"axis": key[0], "op": key[1], "seq": key[2], "waiting": sorted(waiting),
            "missing": sorted(group - issued)}
