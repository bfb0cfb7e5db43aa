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
    raise NotImplementedError("keep a clock per rank and the finish time of every (kind, mb, rank); repeatedly run each rank's next action once its dependency has finished")
