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


# the mistakes issue 32 names, and the check that must catch each (on every seed)
CAUGHT_BY = {("lse_merge", "merge_exp_direct"): "stable", ("explain_hang", "last_pending"): "collective",
             ("recompute", "whole_attention"): "selective", ("zero1", "all_reduce"): "all_gather",
             ("bubble", "closed_form"): "dependencies", ("tp_linear", "f_g_swapped"): "forward",
             ("one_f_one_b", "warmup_one_more"): "warmup", ("grad_buckets", "no_divide"): "averages",
             ("grad_buckets", "last_twice"): "bucket_count", ("ring_allreduce", "no_average"): "averages",
             ("a2a_volume", "once_per_token"): "volume", ("a2a_volume", "local_counted"): "local_share",
             ("a2a_volume", "undo_forgotten"): "undo", ("a2a_volume", "permutation_again"): "undo"}


def _score(ex, who: str, seed: int):
    """(points, failure messages, names of the failed checks) of one answer on one seed."""
    impl = answer(ex.name, who)
    outs = [runner.run_check(ex, c, _key(who), seed, shortcut=False, impl=impl) for c in ex.checks]
    lost = [o for o in outs if o.earned < o.points]
    return sum(o.earned for o in outs), [o.message for o in lost], {o.check for o in lost}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ex", EXERCISES, ids=[e.name for e in EXERCISES])
def test_reference_full_marks_and_wrong_answers_fail_on_every_seed(ex, request):
    if ex.scenario is not None:
        request.getfixturevalue("scenarios")
    bad = []
    for seed in SEEDS:
        got, why, _ = _score(ex, "solutions", seed)
        if got != ex.points:
            bad.append(f"solutions, seed {seed}: {got}/{ex.points}: {why}")
        for who, _ in WRONG[ex.name]:
            got, _, lost = _score(ex, who, seed)
            if got == ex.points:
                bad.append(f"wrong answer {who!r} scores {got}/{ex.points} on seed {seed}")
            if CAUGHT_BY.get((ex.name, who), next(iter(lost), None)) not in lost:
                bad.append(f"wrong answer {who!r} passes {CAUGHT_BY[(ex.name, who)]!r} on seed {seed}")
    assert bad == []


def test_every_exercise_has_typical_wrong_answers():
    assert {ex.name for ex in EXERCISES} == set(WRONG)
    assert all(len(WRONG[ex.name]) >= 2 for ex in EXERCISES)
    assert all(who in dict(WRONG[ex]) for ex, who in CAUGHT_BY)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("who,hint", [("f_g_swapped", "f (CopyToTP) is the identity going forward"),
                                      ("no_f", "f (CopyToTP) all-reduces (sums) it in backward"),
                                      ("bias_before_sum", "the full bias is added once, after the sum")])
def test_tp_linear_failure_names_the_operator(who, hint, scenarios):
    ex = grading.find(["tp_linear"])[0]
    for seed in SEEDS[:3]:
        msgs = _score(ex, who, seed)[1]
        assert any(hint in m for m in msgs), msgs
