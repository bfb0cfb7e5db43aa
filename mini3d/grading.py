"""The exercise grader: one list of named, weighted checks per exercise, used by pytest and `mini3d grade`.

An exercise is a module with the same name in `exercises/` (the stubs a learner fills in) and in
`solutions/` (the references). Each exercise owns a list of `Check`s; a check is a function
`check(ctx)` that calls the implementation `ctx.impl` on randomised inputs (drawn from `ctx.rng`,
seeded from the printed grading seed, so a failure reproduces) and raises `CheckFailed` with a
message that says what was expected and what came back. Distributed exercises first run one
multi-process scenario on gloo (`Exercise.scenario`, launched once per exercise and cached), and
their checks read the per-rank results from `ctx.results`.

`tests/test_exercises.py` parametrizes over exactly these checks; `mini3d grade` runs them and prints
a score table. Both go through `run_check`, so the two can never disagree.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
import traceback
from dataclasses import dataclass

IMPLS = ("exercises", "solutions")


class CheckFailed(AssertionError):
    """A check's learner-facing verdict: what was expected and what came back."""


def expect(ok: bool, what: str, expected, got):
    """Fail with 'what: expected X, got Y' unless `ok`."""
    if not ok:
        raise CheckFailed(f"{what}: expected {expected}, got {got}")


@dataclass
class Check:
    name: str  # short id, e.g. "averages"
    points: int  # weight in the score
    fn: object  # fn(ctx) -> None, raises CheckFailed
    doc: str = ""  # one line shown in the table


@dataclass
class Exercise:
    name: str  # module name in exercises/ and solutions/
    chapter: str  # e.g. "05 pipeline parallelism"
    checks: list[Check]
    scenario: object = None  # fn(impl, seed) -> per-rank results, for distributed exercises
    world: object = None  # fn(rng) -> world size of the scenario (<= 4)

    @property
    def points(self) -> int:
        return sum(c.points for c in self.checks)


@dataclass
class Context:
    impl_name: str  # "exercises", "solutions", or a package path such as tests.fixtures.wrong_answers
    exercise: Exercise
    check: Check
    seed: int
    impl: object = None  # the imported module
    results: object = None  # per-rank scenario results (distributed exercises)

    @property
    def rng(self) -> random.Random:
        return random.Random(f"{self.seed}:{self.exercise.name}:{self.check.name}")


@dataclass
class Outcome:
    exercise: str
    check: str
    points: int
    earned: int
    message: str = ""  # empty when passed


_scenario_cache: dict = {}


def ensure_importable():
    """Put the repository root (holding exercises/ and solutions/) on sys.path."""
    for root in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
        if os.path.isdir(os.path.join(root, "exercises")) and root not in sys.path:
            sys.path.insert(0, root)


def load_impl(impl_name: str, exercise: str):
    ensure_importable()
    return importlib.import_module(f"{impl_name}.{exercise}")


def scenario_results(ex: Exercise, impl_name: str, seed: int):
    """Run the exercise's multi-process scenario once per (exercise, impl, seed); cache the outcome."""
    key = (ex.name, impl_name, seed)
    if key not in _scenario_cache:
        from .launch import LaunchTimeout, WorkerError, launch
        from . import grading_workers

        world = ex.world(random.Random(f"{seed}:{ex.name}:world"))
        try:
            _scenario_cache[key] = launch(grading_workers.run_scenario, world, ex.scenario, ex.name,
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
    from . import grading_3d, grading_checks, grading_plan, grading_tp, grading_workers

    exs = (grading_checks.EXERCISES + grading_workers.EXERCISES + grading_tp.EXERCISES
           + grading_plan.EXERCISES + grading_3d.EXERCISES)
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


def cmd_grade(args) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    try:
        find(args.exercise)
    except KeyError as e:
        print(f"mini3d grade: bad input: {e.args[0]}", file=sys.stderr)
        return 2
    impl = args.impl
    try:
        ensure_importable()
        importlib.import_module(impl)
    except ImportError:
        print(f"mini3d grade: bad input: --impl {impl!r} is not importable from {os.getcwd()} "
              f"(run from the repository root, which holds exercises/ and solutions/)", file=sys.stderr)
        return 2
    print(f"grading {impl} with seed {seed} (rerun with --seed {seed} to reproduce)", flush=True)
    outcomes = grade(impl, args.exercise, seed)
    print(score_table(outcomes, seed))
    return 0 if all(o.earned for o in outcomes) else 1


def register(subparsers):
    p = subparsers.add_parser("grade", help="grade the exercises (or the reference solutions)",
                              description="Run each exercise's checks and print points per exercise "
                                          "with the first failing check in words. Exit 0 when all "
                                          "pass, 1 when some fail, 2 for bad input.")
    p.add_argument("exercise", nargs="*", help="exercise names (default: all)")
    p.add_argument("--impl", default="exercises",
                   help="exercises (your answers, default), solutions, or a package path")
    p.add_argument("--seed", type=int, help="grading seed (default: random, printed)")
    p.set_defaults(func=cmd_grade)


__all__ = ["Check", "CheckFailed", "Exercise", "Outcome", "expect", "grade", "run_check",
           "all_exercises", "find", "score_table", "register"]
