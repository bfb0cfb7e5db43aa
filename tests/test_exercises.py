"""Graded exercises: every check of every exercise, against `--impl` (default solutions, as in CI).

The checks themselves live in mini3d/course/grading/, so `mini3d grade` and this file judge alike.
Shapes, meshes and data come from the grading seed printed in pytest's header; rerun a failure with
`--grade-seed N`. Distributed exercises launch one gloo job (<= 4 ranks) per exercise, cached
across that exercise's checks; under `--impl solutions` (CI) the references' scenarios all run in
one launch instead (tests/grader_variants/batch.py, as tests/test_grader_seeds.py runs them), and
the grader's own launch path (one job per scenario part) is run by the wrong ring answer and the
untouched stubs below. (CI time: the references' 8 launches took 45-50 s of the file's 100 s.)
"""

import pytest

from mini3d.course import grading
from mini3d.course.grading import runner
from mini3d.cli import main

CASES = [(ex, c) for ex in grading.all_exercises() for c in ex.checks]


@pytest.fixture(scope="module")
def reference_scenarios(impl, grade_seed):
    """Under `--impl solutions`: every distributed reference's scenario at the grading seed, run in
    one launch and cached where run_check looks for them (a learner's exercises/ keep one launch
    each: an answer that deadlocks must cost only its own exercise)."""
    if impl != "solutions":
        return
    from tests.grader_variants.batch import run_batches

    jobs = [(ex.name, "solutions", grade_seed) for ex in grading.all_exercises() if ex.scenario is not None]
    for (name, who, seed), recs in run_batches(jobs).items():
        runner._scenario_cache.setdefault((name, who, seed), recs)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ex,check", CASES, ids=[f"{e.name}::{c.name}[{c.points}pt]" for e, c in CASES])
def test_check(ex, check, impl, grade_seed, request):
    if ex.scenario is not None:
        request.getfixturevalue("reference_scenarios")
    out = grading.run_check(ex, check, impl, grade_seed)
    assert out.earned == check.points, f"{ex.name}::{check.name} ({check.doc}): {out.message}"


def test_every_exercise_names_its_chapter_and_has_both_modules():
    chapters = {"00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10"}
    exs = grading.all_exercises()
    assert len(exs) >= 10
    for ex in exs:
        assert ex.chapter[:2] in chapters and ex.points > 0
        for impl in grading.IMPLS:
            doc = grading.load_impl(impl, ex.name).__doc__
            assert f"Chapter: {ex.chapter}" in doc, f"{impl}/{ex.name}.py must name its chapter"
    with open("exercises/README.md") as f:
        readme = f.read()
    assert all(f"`{ex.name}`" in readme and f"| {ex.points} |" in readme for ex in exs)


@pytest.mark.timeout(600)
def test_solutions_score_100_percent(grade_seed, reference_scenarios):
    outs = grading.grade("solutions", seed=grade_seed)  # distributed runs are cached from test_check
    assert [o.message for o in outs if not o.earned] == []
    assert sum(o.earned for o in outs) == sum(ex.points for ex in grading.all_exercises())


@pytest.mark.timeout(240)
def test_untouched_stubs_score_zero(impl, grade_seed):
    if impl == "exercises":
        pytest.skip("learner mode: exercises/ is being filled in, so it is no longer the stubs")
    outs = grading.grade("exercises", seed=grade_seed)
    assert sum(o.earned for o in outs) == 0
    assert all("not implemented yet" in o.message for o in outs)
    # the same verdict without the untouched-stub shortcut: really start the processes once (zero1:
    # one 2-3 rank launch; ring_allreduce's two 3-4 rank launches took 26 s)
    zero1 = grading.find(["zero1"])[0]
    real = [grading.run_check(zero1, c, "exercises", grade_seed, shortcut=False) for c in zero1.checks]
    assert sum(o.earned for o in real) == 0 and all("not implemented" in o.message for o in real)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,broken", [("one_f_one_b", "exact_order"), ("ring_allreduce", "averages"),
                                         ("grad_norm", "replicated_once"), ("lse_merge", "stable"),
                                         ("zb_h1", "exact_order")])
def test_wrong_answer_loses_exactly_its_check(name, broken, grade_seed):
    ex = grading.find([name])[0]
    outs = grading.grade("tests.fixtures.wrong_answers", [name], seed=grade_seed)
    assert [o.check for o in outs if not o.earned] == [broken], [o.message for o in outs]
    lost = next(c.points for c in ex.checks if c.name == broken)
    assert sum(o.earned for o in outs) == ex.points - lost
    msg = next(o.message for o in outs if not o.earned)
    assert "expected" in msg and "got" in msg and f"seed {grade_seed}" in msg


@pytest.mark.timeout(120)
def test_grade_cli_table_and_exit_codes(capsys):
    assert main(["grade", "--impl", "solutions", "--seed", "5", "one_f_one_b", "rank_grid"]) == 0
    out = capsys.readouterr().out
    assert "seed 5" in out and "10/10" in out and "5/5" in out and "15/15" in out
    assert main(["grade", "--impl", "tests.fixtures.wrong_answers", "--seed", "5", "one_f_one_b"]) == 1
    out = capsys.readouterr().out
    assert "7/10" in out and "exact_order: pp=" in out and "expected" in out
    assert main(["grade", "no_such_exercise"]) == 2
    assert "no_such_exercise" in capsys.readouterr().err
    assert main(["grade", "--impl", "nowhere", "bubble"]) == 2


def test_checks_are_randomised_by_seed():
    ex = grading.find(["one_f_one_b"])[0]
    c = ex.checks[0]
    a, b = (grading.Context("solutions", ex, c, s).rng.random() for s in (1, 2))
    assert a != b and grading.Context("solutions", ex, c, 1).rng.random() == a
