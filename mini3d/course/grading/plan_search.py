"""Checks of exercise 13, plan_search (chapter 09): a planner search under a memory limit.

The ground truth is mini3d's own planner enumeration (`mini3d.cost.planner.candidate_plans`,
restricted to the exercise's 1F1B space) timed by `mini3d.cost.model.estimate_cost`; the learner's
answer must not call the planner. Cases are random: model shape, GPU count, global batch, sequence
length, accelerator and a memory limit drawn between the smallest and the largest plan's memory.
"""

from __future__ import annotations

import ast
import inspect

from mini3d.config import ModelConfig, Plan
from mini3d.course.grading.core import Check, CheckFailed, Exercise, expect

_TRUTH: dict = {}
DEFAULT_SCHEDULE = Plan().schedule  # 1F1B: the exercise's space is the planner's plans with it


def _case(rng) -> dict:
    """A random small planning problem (kept small so the search takes well under a second)."""
    from mini3d.cost.hardware import PRESETS as GPUS

    heads = rng.choice([8, 12, 16])
    cfg = ModelConfig(n_layers=rng.choice([4, 6, 8, 12]), d_model=heads * rng.choice([64, 128]),
                      n_heads=heads, vocab_size=rng.choice([32000, 50257]), max_seq_len=2048,
                      name="random")
    return dict(cfg=cfg, n_gpus=rng.choice([4, 8]), global_batch=rng.choice([8, 16]),
                seq_len=rng.choice([512, 1024, 2048]), hw=GPUS[rng.choice(sorted(GPUS))])


def _truth(case: dict) -> list[tuple]:
    """[(plan, memory bytes, step seconds)] of the exercise's search space, by the planner."""
    from mini3d.cost.model import estimate_cost
    from mini3d.cost.planner import candidate_plans
    from mini3d.cost.memory import estimate_memory

    key = tuple(sorted((k, repr(v)) for k, v in case.items()))
    if key not in _TRUTH:
        c = case
        plans = [p for p in candidate_plans(c["cfg"], c["n_gpus"], c["global_batch"], c["seq_len"])
                 if p.schedule == DEFAULT_SCHEDULE]
        _TRUTH[key] = [(p, estimate_memory(c["cfg"], p).total,
                        estimate_cost(c["cfg"], p, c["hw"], c["n_gpus"]).step_time_s) for p in plans]
    return _TRUTH[key]


def _args(c: dict) -> str:
    return (f"(n_layers={c['cfg'].n_layers}, d_model={c['cfg'].d_model}, n_heads={c['cfg'].n_heads}, "
            f"n_gpus={c['n_gpus']}, global_batch={c['global_batch']}, seq_len={c['seq_len']}, "
            f"{c['hw'].name})")


def _no_planner(ctx):
    """The point is to build the search: refuse an answer that imports mini3d.cost.planner."""
    tree = ast.parse(inspect.getsource(ctx.impl))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        if any("cost.planner" in n for n in names):
            raise CheckFailed("plan_search must build its own search: expected no use of "
                              "mini3d.cost.planner, got an import of it")


def layouts_ok(ctx):
    for _ in range(3):
        c = _case(ctx.rng)
        cfg, n = c["cfg"], ctx.rng.choice([4, 8, 12, 16])
        truth = sorted((tp, pp, n // (tp * pp)) for tp in range(1, n + 1) for pp in range(1, n + 1)
                       if n % (tp * pp) == 0 and cfg.n_heads % tp == 0 and cfg.d_ff % tp == 0
                       and pp <= cfg.n_layers)
        got = ctx.impl.layouts(cfg, n)
        expect(list(got) == truth, f"layouts(n_heads={cfg.n_heads}, d_ff={cfg.d_ff}, n_layers="
               f"{cfg.n_layers}, n_gpus={n})", truth, got)


def candidates_ok(ctx):
    _no_planner(ctx)
    c = _case(ctx.rng)
    truth = {p for p, _, _ in _truth(c)}
    got = ctx.impl.candidates(c["cfg"], c["n_gpus"], c["global_batch"], c["seq_len"])
    got_set = set(got)
    missing, extra = truth - got_set, got_set - truth
    expect(not missing and not extra and len(got) == len(got_set), f"candidates{_args(c)}",
           f"{len(truth)} distinct valid plans",
           f"{len(got)} plans; missing e.g. {sorted(missing, key=repr)[:1]}, extra e.g. "
           f"{sorted(extra, key=repr)[:1]}")


def _limit(ctx, rows, where: float) -> float:
    mems = sorted(m for _, m, _ in rows)
    return mems[0] + where * (mems[-1] - mems[0])


def _check_best(ctx, c, limit, what):
    from mini3d.cost.memory import gib

    rows = _truth(c)
    fitting = [r for r in rows if r[1] <= limit]
    got = ctx.impl.best_plan(c["cfg"], c["n_gpus"], c["hw"], c["global_batch"], c["seq_len"], limit)
    if not fitting:
        expect(got is None, f"best_plan{_args(c)} with a limit of {gib(limit, 3)} ({what})",
               "None (no plan fits)", got)
        return
    best = min(fitting, key=lambda r: r[2])
    row = next((r for r in rows if r[0] == got), None)
    expect(row is not None, f"best_plan{_args(c)}, limit {gib(limit, 3)} ({what})",
           "one of the candidate plans", got)
    expect(row[1] <= limit, f"memory of best_plan{_args(c)} ({what})",
           f"<= the limit {gib(limit, 3)}", f"{gib(row[1], 3)} for {got}")
    expect(abs(row[2] - best[2]) <= 1e-9 * best[2], f"step time of best_plan{_args(c)}, limit "
           f"{gib(limit, 3)} ({what})", f"{best[2]:.6f} s ({best[0]})", f"{row[2]:.6f} s ({got})")


def fits_and_fastest(ctx):
    for _ in range(2):
        c = _case(ctx.rng)
        _check_best(ctx, c, _limit(ctx, _truth(c), ctx.rng.uniform(0.05, 0.6)), "a random limit")


def tight_limit(ctx):
    """A limit just below the memory of the unconstrained fastest plan: speed must be traded."""
    c = _case(ctx.rng)
    rows = _truth(c)
    fastest = min(rows, key=lambda r: (r[2], r[1]))
    lower = [m for _, m, _ in rows if m < fastest[1]]
    limit = max(lower) if lower else fastest[1]
    _check_best(ctx, c, limit, "just below the fastest plan's memory")


def nothing_fits(ctx):
    c = _case(ctx.rng)
    limit = min(m for _, m, _ in _truth(c)) * ctx.rng.uniform(0.5, 0.99)
    _check_best(ctx, c, limit, "below every plan's memory")


EXERCISES = [
    Exercise("plan_search", "09 planning a real run", [
        Check("layouts", 2, layouts_ok, "every (tp, pp, dp) of n_gpus"),
        Check("candidates", 3, candidates_ok, "the whole 1F1B search space, valid plans only"),
        Check("fastest_fit", 3, fits_and_fastest, "fits the limit and is the fastest that does"),
        Check("tight_limit", 2, tight_limit, "trades speed for memory under a tight limit"),
        Check("nothing_fits", 1, nothing_fits, "None when no plan fits"),
    ]),
]

__all__ = ["EXERCISES"]
