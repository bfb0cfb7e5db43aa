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
    raise NotImplementedError("take the pending event with the smallest start; compare its (axis, op, seq) with every group member's log")
