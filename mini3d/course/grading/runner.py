"""Running the checks: one check (`run_check`), every exercise (`all_exercises`), a score table.

A distributed exercise's scenario is launched once per (exercise, impl, seed) on gloo and cached, so
its checks share one run.
"""

from __future__ import annotations

import os
import random
import traceback

from mini3d.course.grading import (data_parallel, experts, grad_norm, hangs, long_sequences, memory,
                                   pipeline, plan_search, rank_grid, recompute, tensor_parallel,
                                   zero_bubble)
from mini3d.course.grading.core import Check, CheckFailed, Context, Exercise, Outcome, load_impl
from mini3d.course.grading.scenario import run_scenario

_scenario_cache: dict = {}


def _launch_part(part, ex: Exercise, impl_name: str, seed: int, world: int):
    """Per-rank results of one scenario function, or the CheckFailed that says why there are none."""
    from mini3d.launch.launcher import LaunchTimeout, WorkerError, launch

    try:
        # a learner's code is graded with torch's ordinary default device, whatever the caller's
        # MINI3D_STRICT_DEVICE: the exercises teach the algorithm, not device placement; and by
        # its checks, not by the suite's NCCL-ordering judge (MINI3D_CHECK_P2P), which is for the
        # engine: the ring exercise's send-then-receive is gloo's lesson (chapter 02)
        return launch(run_scenario, world, part, ex.name, impl_name, seed, timeout=120,
                      env={"MINI3D_STRICT_DEVICE": "0", "MINI3D_CHECK_P2P": "0"})
    except LaunchTimeout as e:
        return CheckFailed(f"the {world}-rank run did not finish ({e}); a rank is probably waiting for a "
                           f"message no one sends: check the order of your sends and receives")
    except WorkerError as e:
        return CheckFailed(f"rank {e.rank} crashed: {e.message}" + getattr(part, "crash_hint", ""))


def scenario_results(ex: Exercise, impl_name: str, seed: int):
    """Run the exercise's multi-process scenario once per (exercise, impl, seed); cache the outcome.

    `ex.scenario` is one function, or a tuple of them, each launched on its own, so that a crash in
    a later one (a function with `.cases`, the case names it returns) fails only the checks that
    read those cases."""
    key = (ex.name, impl_name, seed)
    if key not in _scenario_cache:
        world = ex.world(random.Random(f"{seed}:{ex.name}:world"))
        parts = ex.scenario if isinstance(ex.scenario, tuple) else (ex.scenario,)
        merged = [{} for _ in range(world)]
        for part in parts:
            res = _launch_part(part, ex, impl_name, seed, world)
            if isinstance(res, Exception) and not hasattr(part, "cases"):
                merged = res
                break
            for rank in range(world):
                merged[rank].update({c: {"error": ("crash", str(res))} for c in part.cases}
                                    if isinstance(res, Exception) else res[rank])
        _scenario_cache[key] = merged
    return _scenario_cache[key]


def _stub_hints(module) -> list[tuple[str, str]] | None:
    """[(function, hint), ...] when every function in the module's source is still only a docstring
    and `raise NotImplementedError(hint)`; None as soon as one has been written."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    fns = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    hints = []
    for fn in fns:
        body = [b for b in fn.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
        if not (len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])):
            return None
        exc = body[0].exc
        arg = exc.args[0] if isinstance(exc, ast.Call) and exc.args else None
        hints.append((fn.name, arg.value if isinstance(arg, ast.Constant) else ""))
    return hints or None


def untouched(module) -> bool:
    """True when every function in the module's source is still only a docstring and
    `raise NotImplementedError(...)`: nothing to run, so no processes need starting."""
    return _stub_hints(module) is not None


def stub_message(module) -> str:
    """'every function is still a stub; start with f(): <the stub's own hint>'."""
    name, hint = _stub_hints(module)[0]
    return f"every function is still a stub; start with {name}(): {hint}" if hint else \
        f"every function is still a stub; start with {name}()"


def run_check(ex: Exercise, check: Check, impl_name: str, seed: int, shortcut: bool = True,
              impl=None) -> Outcome:
    """Run one check; never raises. A failure carries a learner-friendly message.
    `shortcut`: skip launching processes for a module whose stubs are all untouched.
    `impl`: an implementation already in hand (a module built in memory, as tests/grader_variants
    builds its wrong answers) instead of importing `impl_name.<exercise>`; its scenario results are
    still looked up (and cached) under `impl_name`."""
    ctx = Context(impl_name, ex, check, seed)
    try:
        ctx.impl = impl if impl is not None else load_impl(impl_name, ex.name)
        if ex.scenario is not None and shortcut and untouched(ctx.impl):
            raise NotImplementedError(stub_message(ctx.impl))
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
           + plan_search.EXERCISES + grad_norm.EXERCISES + long_sequences.EXERCISES + experts.EXERCISES)
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


def check_lines(ex: Exercise, outcomes: list[Outcome]) -> list[str]:
    """One line per check, passed or failed, with its points: '  [2/2] pass  uneven: ...'; a failure
    is followed by its message, indented."""
    docs = {c.name: c.doc for c in ex.checks}
    out, last = [], None
    for o in outcomes:
        verdict = "pass" if o.earned == o.points else "FAIL"
        out.append(f"  [{o.earned}/{o.points}] {verdict}  {o.check}: {docs.get(o.check, '')}")
        if o.message:
            why = o.message.split("] ", 1)[-1]
            out += ["         " + line for line in ("(the same as above)" if why == last else why).splitlines()]
            last = why
    return out


def score_table(outcomes: list[Outcome], seed: int) -> str:
    """Points per exercise, each check with its points (pass or fail, and why), and the total."""
    order = list(dict.fromkeys(o.exercise for o in outcomes))
    by = {e.name: e for e in all_exercises()}
    lines = [f"{'exercise':<16} {'chapter':<28} {'points':>9}   first problem", "-" * 96]
    for name in order:
        mine = [o for o in outcomes if o.exercise == name]
        got, tot = sum(o.earned for o in mine), sum(o.points for o in mine)
        fail = next((o for o in mine if not o.earned), None)
        note = f"{fail.check}: {fail.message.split('] ', 1)[-1].splitlines()[0]}" if fail else "all checks pass"
        lines.append(f"{name:<16} {by[name].chapter:<28} {got:>4}/{tot:<4}   {note}")
        lines += check_lines(by[name], mine)
    got, tot = sum(o.earned for o in outcomes), sum(o.points for o in outcomes)
    lines += ["-" * 96, f"{'total':<45} {got:>4}/{tot:<4}   ({100 * got / max(tot, 1):.0f}%, seed {seed})"]
    return "\n".join(lines)
