"""The grader over seeds 0-19: the reference solution of every exercise scores full marks on every
seed, and every typical wrong answer (tests/grader_variants/: the reference with one mistake)
loses points on every seed, so a learner's grade never depends on the seed drawn.

Everything is graded in this process through `runner.run_check` (the path `mini3d grade` takes);
the distributed exercises' scenarios run first, all (exercise, answer, seed) jobs of one world size
in one gloo launch (tests/grader_variants/batch.py), and each seed's results are reused by all of
that exercise's checks.
"""

from __future__ import annotations

import pytest

from mini3d.course import grading
from mini3d.course.grading import runner
from tests.grader_variants import answer, wrong_answers
from tests.grader_variants.batch import run_batches

SEEDS = range(20)
EXERCISES = grading.all_exercises()
WRONG = wrong_answers()


def _key(who: str) -> str:
    return f"seed-test:{who}"  # scenario-cache key, apart from test_exercises' own runs


@pytest.fixture(scope="module")
def scenarios():
    """Run every distributed job once (three launches: worlds 2, 3, 4) and cache the results where
    run_check looks for them."""
    jobs = [(ex.name, who, seed) for ex in EXERCISES if ex.scenario is not None
            for who in ["solutions"] + [n for n, _ in WRONG[ex.name]] for seed in SEEDS]
    for (name, who, seed), recs in run_batches(jobs).items():
        runner._scenario_cache[(name, _key(who), seed)] = recs


def _score(ex, who: str, seed: int):
    impl = answer(ex.name, who)
    outs = [runner.run_check(ex, c, _key(who), seed, shortcut=False, impl=impl) for c in ex.checks]
    return sum(o.earned for o in outs), [o.message for o in outs if o.earned < o.points]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ex", EXERCISES, ids=[e.name for e in EXERCISES])
def test_reference_full_marks_and_wrong_answers_fail_on_every_seed(ex, request):
    if ex.scenario is not None:
        request.getfixturevalue("scenarios")
    bad = []
    for seed in SEEDS:
        got, why = _score(ex, "solutions", seed)
        if got != ex.points:
            bad.append(f"solutions, seed {seed}: {got}/{ex.points}: {why}")
        for who, _ in WRONG[ex.name]:
            got, _ = _score(ex, who, seed)
            if got == ex.points:
                bad.append(f"wrong answer {who!r} scores {got}/{ex.points} on seed {seed}")
    assert bad == []


def test_every_exercise_has_typical_wrong_answers():
    assert {ex.name for ex in EXERCISES} == set(WRONG)
    assert all(len(WRONG[ex.name]) >= 2 for ex in EXERCISES)
    named = {"lse_merge": "merge_exp_direct", "explain_hang": "last_pending", "recompute": "whole_attention",
             "zero1": "all_reduce", "bubble": "closed_form", "tp_linear": "f_g_swapped",
             "one_f_one_b": "warmup_one_more", "grad_buckets": "no_divide"}
    assert all(want in dict(WRONG[ex]) for ex, want in named.items())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("who,hint", [("f_g_swapped", "f (CopyToTP) is the identity going forward"),
                                      ("no_f", "f (CopyToTP) all-reduces (sums) it in backward"),
                                      ("bias_before_sum", "the full bias is added once, after the sum")])
def test_tp_linear_failure_names_the_operator(who, hint, scenarios):
    ex = grading.find(["tp_linear"])[0]
    for seed in SEEDS[:3]:
        assert any(hint in m for m in _score(ex, who, seed)[1]), _score(ex, who, seed)[1]
