"""Running the checks: one check (`run_check`), every exercise (`all_exercises`), a score table.

A distributed exercise's scenario is launched once per (exercise, impl, seed) on gloo and cached, so
its checks share one run.
"""

from __future__ import annotations

import os
import random
import traceback

from . import (data_parallel, grad_norm, hangs, memory, pipeline, plan_search, rank_grid, recompute,
               tensor_parallel, zero_bubble)
from .core import Check, CheckFailed, Context, Exercise, Outcome, load_impl
from .scenario import run_scenario

_scenario_cache: dict = {}


def scenario_results(ex: Exercise, impl_name: str, seed: int):
    """Run the exercise's multi-process scenario once per (exercise, impl, seed); cache the outcome."""
    key = (ex.name, impl_name, seed)
    if key not in _scenario_cache:
        from mini3d.launch import LaunchTimeout, WorkerError, launch

        world = ex.world(random.Random(f"{seed}:{ex.name}:world"))
        try:
            _scenario_cache[key] = launch(run_scenario, world, ex.scenario, ex.name,
                                          impl_name, seed, timeout=120)
        except LaunchTimeout as e:
            _scenario_cache[key] = CheckFailed(
                f"the {world}-rank run did not finish ({e}); a rank is probably waiting for a "
                f"message no one sends: check the order of your sends and receives")
        except WorkerError as e:
            _scenario_cache[key] = CheckFailed(f"rank {e.rank} crashed: {e.message}")
    return _scenario_cache[key]


def untouched(module) -> bool:
    """True when every function in the module's source is still only a docstring and
    `raise NotImplementedError(...)`: nothing to run, so no processes need starting."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    fns = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def stub(fn):
        body = [b for b in fn.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
        return (len(body) == 1 and isinstance(body[0], ast.Raise)
                and "NotImplementedError" in ast.unparse(body[0]))
    return bool(fns) and all(stub(f) for f in fns)


def run_check(ex: Exercise, check: Check, impl_name: str, seed: int, shortcut: bool = True) -> Outcome:
    """Run one check; never raises. A failure carries a learner-friendly message.
    `shortcut`: skip launching processes for a module whose stubs are all untouched."""
    ctx = Context(impl_name, ex, check, seed)
    try:
        ctx.impl = load_impl(impl_name, ex.name)
        if ex.scenario is not None and shortcut and untouched(ctx.impl):
            raise NotImplementedError("every function is still a stub: start with the first one")
        if ex.scenario is not None:
            res = scenario_results(ex, impl_name, seed)
            if isinstance(res, Exception):
                raise res
            ctx.results = res
        check.fn(ctx)
        return Outcome(ex.name, check.name, check.points, check.points)
    except NotImplementedError as e:
        msg = f"not implemented yet ({e})" if str(e) else "not implemented yet"
    except CheckFailed as e:
        msg = str(e)
    except AssertionError as e:
        msg = str(e) or "an assertion failed"
    except Exception as e:  # the learner's code raised: show where
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)
                      if impl_name.split(".")[0] in f.filename or "exercises" in f.filename), "")
        msg = f"raised {type(e).__name__}: {e}" + (f" (at {where})" if where else "")
    return Outcome(ex.name, check.name, check.points, 0, f"[seed {seed}] {msg}")


def all_exercises() -> list[Exercise]:
    exs = (memory.EXERCISES + pipeline.EXERCISES + zero_bubble.EXERCISES + rank_grid.EXERCISES + recompute.EXERCISES
           + hangs.EXERCISES + data_parallel.EXERCISES + tensor_parallel.EXERCISES
           + plan_search.EXERCISES + grad_norm.EXERCISES)
    return sorted(exs, key=lambda e: e.chapter)  # stable: course order


def find(names) -> list[Exercise]:
    exs = all_exercises()
    if not names:
        return exs
    by = {e.name: e for e in exs}
    bad = [n for n in names if n not in by]
    if bad:
        raise KeyError(f"unknown exercise(s) {', '.join(bad)} (choose from {', '.join(by)})")
    return [by[n] for n in names]


def grade(impl_name: str = "solutions", names=(), seed: int = 0, shortcut: bool = True) -> list[Outcome]:
    return [run_check(ex, c, impl_name, seed, shortcut) for ex in find(names) for c in ex.checks]


def score_table(outcomes: list[Outcome], seed: int) -> str:
    """Points per exercise, the total, and each exercise's first failing check in words."""
    order = list(dict.fromkeys(o.exercise for o in outcomes))
    chapters = {e.name: e.chapter for e in all_exercises()}
    lines = [f"{'exercise':<16} {'chapter':<28} {'points':>9}   first problem", "-" * 96]
    for name in order:
        mine = [o for o in outcomes if o.exercise == name]
        got, tot = sum(o.earned for o in mine), sum(o.points for o in mine)
        fail = next((o for o in mine if not o.earned), None)
        note = f"{fail.check}: {fail.message.split('] ', 1)[-1]}" if fail else "all checks pass"
        lines.append(f"{name:<16} {chapters[name]:<28} {got:>4}/{tot:<4}   {note}")
    got, tot = sum(o.earned for o in outcomes), sum(o.points for o in outcomes)
    lines += ["-" * 96, f"{'total':<45} {got:>4}/{tot:<4}   ({100 * got / max(tot, 1):.0f}%, seed {seed})"]
    return "\n".join(lines)


