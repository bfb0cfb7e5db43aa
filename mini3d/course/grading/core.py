"""What a grading check is: `Check`, `Exercise`, the `Context` a check reads, and `expect`.

An exercise is a module with the same name in `exercises/` (the stubs a learner fills in) and in
`solutions/` (the references). Each exercise owns a list of `Check`s; a check is a function
`check(ctx)` that calls the implementation `ctx.impl` on randomised inputs (drawn from `ctx.rng`,
seeded from the printed grading seed, so a failure reproduces) and raises `CheckFailed` with a
message that says what was expected and what came back. Distributed exercises first run one
multi-process scenario on gloo (`Exercise.scenario`, launched once per exercise and cached), and
their checks read the per-rank results from `ctx.results`.

`tests/test_exercises.py` parametrizes over exactly these checks; `mini3d grade` runs them and prints
a score table. Both go through `runner.run_check`, so the two can never disagree.

The package is layered so nothing imports in a circle: `core` (this file) <- the check modules
(one per exercise idea, each with its `EXERCISES`) <- `runner` (runs checks, collects every
exercise) <- `cli` (`mini3d grade`).
"""

from __future__ import annotations

import importlib
import os
import random
import sys
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


def ensure_importable():
    """Put the repository root (holding exercises/ and solutions/) on sys.path: the working directory,
    else its parent (a chapter notebook runs in course/), else the checkout mini3d was imported from;
    the first of these that holds exercises/ comes first on sys.path."""
    here = os.path.dirname(os.path.abspath(__file__))
    roots = (os.getcwd(), os.path.dirname(os.getcwd()), os.path.abspath(os.path.join(here, *[".."] * 3)))
    for root in reversed([r for r in roots if os.path.isdir(os.path.join(r, "exercises"))]):
        if root in sys.path:
            sys.path.remove(root)
        sys.path.insert(0, root)


def load_impl(impl_name: str, exercise: str):
    ensure_importable()
    return importlib.import_module(f"{impl_name}.{exercise}")
