"""Glue from mini3d's own engines to the explorers' function contracts (see `widgets.py`)."""

from __future__ import annotations

from mini3d.pp.schedules import make_schedule
from mini3d.pp.simulator import simulate

from mini3d.course.viz.pipeline import chunks_for


def pp_simulate_fn():
    """`simulate_fn(kind, p, m, v, bwd_ratio)` backed by `mini3d.pp` (make_schedule + simulate).

    Costs are per model chunk: a forward of one chunk takes 1/v, its backward bwd_ratio/v, so the
    total work per micro-batch is the same for every v and only the bubble changes."""
    def simulate_fn(kind, p, m, v=1, bwd_ratio=2.0):
        v = chunks_for(kind, v)  # split schedules: B and W each half of the backward
        return simulate(make_schedule(kind, p, m, v), 1.0 / v, float(bwd_ratio) / v)

    return simulate_fn


def estimate_fn(seq_len: int | None = None, micro_batch_size: int = 1):
    """`estimate_fn(model=, tp=, pp=, dp=, zero=, ...)` backed by `mini3d.cost.memory`:
    the memory of the rank that needs the most, for a preset model name. Invalid plans raise a
    ValueError naming every offending value (shown by the explorer)."""
    from mini3d.config import Plan, PlanError, model_from_preset
    from mini3d.cost.memory import estimate_memory

    def fn(model="gpt-7b", tp=1, pp=1, dp=1, zero=0, micro_batches=1, recompute="none", dtype="bf16"):
        cfg = model_from_preset(model)
        plan = Plan(tp=tp, pp=pp, dp=dp, zero=zero, micro_batches=micro_batches, recompute=recompute,
                    dtype=dtype, global_batch=dp * micro_batches * micro_batch_size,
                    seq_len=seq_len or cfg.max_seq_len, schedule="1f1b")
        problems = plan.problems(cfg)
        if problems:
            raise PlanError(problems)
        return estimate_memory(cfg, plan)

    return fn


__all__ = ["pp_simulate_fn", "estimate_fn"]
