"""Typical wrong answers to every exercise, each built in memory from the reference solution with
one mistake, for tests/test_grader_seeds.py (every one must lose points on every seed).

    variant()     a module: solutions/<exercise>.py with some names replaced
    wrong_answers every exercise's [(name, module)], from the topic files below
    batch         the distributed exercises' scenarios, many (exercise, answer, seed) per launch

    pipeline   one_f_one_b, bubble, zb_h1
    counting   count_params, memory, rank_grid, grad_norm, plan_search, a2a_volume
    attention  lse_merge, recompute, explain_hang
    distributed ring_allreduce, grad_buckets, zero1, tp_linear, vocab_ce
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types

from mini3d.course.grading import ensure_importable


def variant(exercise: str, why: str, **overrides) -> types.ModuleType:
    """solutions/<exercise>.py with `overrides` in place of its names; `why` is the mistake.
    `__file__` is the defining topic file, so a check that reads the source (plan_search refuses
    an import of the planner) reads that file."""
    ensure_importable()
    ref = importlib.import_module(f"solutions.{exercise}")
    mod = types.ModuleType(f"{exercise}_wrong", why)
    mod.__dict__.update({k: v for k, v in vars(ref).items() if not k.startswith("__")})
    mod.__dict__.update(overrides)
    mod.__file__ = inspect.getfile(sys._getframe(1))
    return mod


TOPICS = ("pipeline", "counting", "attention", "distributed")


# the wrong answers of tests/fixtures/ too (not torch_chunk: it aborts gloo, so it runs alone)
FIXTURES = {"wrong_answers": ("grad_norm", "lse_merge", "one_f_one_b", "ring_allreduce", "zb_h1"),
            "reversed_warmup": ("one_f_one_b",)}


def wrong_answers() -> dict[str, list[tuple[str, types.ModuleType]]]:
    """{exercise: [(name, module), ...]} over every topic file and the fixtures."""
    out: dict = {}
    for topic in TOPICS:
        for ex, answers in importlib.import_module(f"{__name__}.{topic}").WRONG.items():
            out.setdefault(ex, []).extend(answers)
    for package, exercises in FIXTURES.items():
        for ex in exercises:
            out[ex].append((f"fixtures.{package}", importlib.import_module(f"tests.fixtures.{package}.{ex}")))
    return out


def answer(exercise: str, name: str):
    """The implementation called `name` of `exercise`: "solutions" or one wrong answer."""
    if name == "solutions":
        ensure_importable()
        return importlib.import_module(f"solutions.{exercise}")
    return dict(wrong_answers()[exercise])[name]
