"""Exercise bubble: simulate a pipeline schedule and measure its bubble.

Chapter: 05 pipeline parallelism (course/05_pipeline_parallelism.ipynb)
"""

from __future__ import annotations


def simulate(schedule: list[list[str]], t_f: float, t_b: float) -> dict:
    """Time a pipeline schedule. `schedule[r]` lists rank r's actions in order ("F2", "B0", ...).

    Each rank runs its actions one after another. F(mb) on rank r may start once F(mb) finished on
    rank r-1; B(mb) on rank r once B(mb) finished on rank r+1 (the last rank: once its own F(mb)
    finished). A forward takes t_f, a backward t_b; communication is free.
    Returns {"makespan": time the last action ends, "bubble_fraction": idle share of
    pp * makespan}."""
    pp = len(schedule)
    done: dict = {}  # (kind, mb, rank) -> finish time
    clock = [0.0] * pp
    pos = [0] * pp
    while any(pos[r] < len(schedule[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(schedule[r]):
                continue
            kind, mb = schedule[r][pos[r]][0], int(schedule[r][pos[r]][1:])
            dep = (("F", mb, r - 1) if kind == "F" and r > 0 else
                   ("B", mb, r + 1) if kind == "B" and r < pp - 1 else
                   ("F", mb, r) if kind == "B" else None)
            if dep is not None and dep not in done:
                continue  # wait for the other rank
            start = max(clock[r], done[dep] if dep else 0.0)
            clock[r] = done[(kind, mb, r)] = start + (t_f if kind == "F" else t_b)
            pos[r] += 1
            progressed = True
        if not progressed:
            raise ValueError("the schedule deadlocks: every rank waits for another")
    makespan = max(clock)
    busy = sum(t_f if a[0] == "F" else t_b for s in schedule for a in s)
    return {"makespan": makespan, "bubble_fraction": 1 - busy / (pp * makespan)}
