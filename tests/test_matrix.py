"""The combination matrix in CI: every pair of option values (tests/matrix: tp, cp, pp, the six
pipeline schedules, dp, ZeRO stage, tied head, family (gpt2, llama, qwen2, qwen3, deepseek: tiny
multi-head latent attention, with moe its grouped sigmoid router), sequence parallelism,
recomputation, clipping, dtype, validation, micro-batches, attention kind, MoE layers, expert
parallelism ep 1 or 2) in a valid case that equals the one-process run (losses, gradient norm and
validation losses of 3 AdamW steps: float64 within 1e-10, bf16 within test_3d's bounds; see
tests/matrix/run.py), or, for the pairs only invalid combinations hold, in an exit-2 case whose
message names the offending values (and one exit-2 case for each rule no such pair needs, e.g. ep
not dividing dp x cp).

CI budget: 3-5 minutes on 2 CPU cores. History, measured on the shared 2-core machine: 44 cases
(4 xfailed) 150-241 s at load average 15-35 from other jobs, about 160 CPU seconds; with the MoE
dimension and the qwen families 50 cases, 353 s at load 20-35. With ep and deepseek (58 valid
cases, total cost 358 against 312 before (`pairwise.cost`), 17 exit-2 cases): 317 s for the
module at load ~8-9 from four other jobs; the array takes 9 s to build. Once ep x ZeRO-3 and MLA
with sequence parallelism were built their rules went: 55 valid cases, 14 exit-2 cases (about
212 s in the clean-clone CI run, one case then hanging 60 s: the expert loop without rows, fixed). The valid cases run in
one launch per world size (1, 2, 4, 8 ranks: each launch runs its cases in sequence) plus one
1-rank launch for the deduplicated references; the cases expected to fail (XFAIL: bugs being fixed
elsewhere) run alone, so that their failure cannot hide the others. `python -m tests.matrix`
prints the same cases as `mini3d train` flags; `--random N --seed S` draws more.
"""

from __future__ import annotations

import random

import pytest

from tests.matrix import (DIMS, MAX_WORLD, RULE_FREE, RULES, describe, expected_messages, model_of, pairs_of,
                          parsed, plan_of, refusals, world)
from tests.matrix.pairwise import _all_pairs, covering_array, random_valid_cases
from tests.matrix.run import check_exit2, prepare_data, run_matrix, spec_of

VALID, EXIT2 = covering_array()
# Cases the random campaign (python -m tests.matrix --random N) found failing that no covering
# case shows (pairs only: the covering array's tied x cp x pp x ZeRO cases are bf16, whose 3 %
# bound hides a 3e-5 error), kept as regression cases.
FOUND = [dict(tp=1, cp=2, pp=2, schedule="gpipe", dp=1, zero=1, tied=True, family="llama", sp=False,
              recompute="none", clip=False, dtype="float64", validation=False, micro_batches=4,
              attention="explicit", moe=False, ep=1)]
CASES = VALID + FOUND
NAMES = [describe(c) for c in CASES]

# Cases expected to fail, each with its bug (strict: a fix turns the entry into a failure, and the
# entry must then go). None now: validation with cp>1 and the tied head x cp x ZeRO x pp gradient,
# the four this array first found failing, are fixed (tests/test_pairs.py pins them too); so is
# the deepseek router's float32 scores in float64 runs (2-3e-9 off in the deepseek x moe x pp
# cases: mini3d/models/routers.py GroupedSigmoidRouter).
XFAIL: dict[str, str] = {}


def test_covering_array_holds_every_pair_once_valid_or_refused():
    covered = set().union(*(pairs_of(c) for c in VALID))
    refused = set().union(*(pairs_of(c) for c in EXIT2))
    assert _all_pairs(DIMS) <= covered | refused
    assert all(world(c) <= MAX_WORLD and not refusals(c) for c in VALID)
    assert all(refusals(c) for c in EXIT2)
    # few cases: the point of a covering array (the ep and deepseek dimensions took it from 49 to
    # 58 valid cases: schedule x family alone needs 30 pipelined ones)
    assert len(VALID) <= 60 and len(EXIT2) <= 18
    assert covering_array() == (VALID, EXIT2)  # deterministic


def problems_of(case: dict) -> list[str]:
    """What `mini3d train` refuses `case` for before any process starts, but the data: Plan's,
    the run's (RunConfig: ep x ZeRO-3, MLA x sequence parallelism) and the run checks'
    (sequence parallelism without tp)."""
    from mini3d.run.checks import run_problems
    from mini3d.run.config import RunConfig

    model, plan = model_of(case), plan_of(case)
    return (RunConfig(model=model, plan=plan).problems(world(case))
            + run_problems(parsed(case), plan, model))


def test_the_rules_explain_every_refusal_of_plan_validation():
    """The matrix's RULES and mini3d's validation agree: a valid matrix case has no problem (Plan,
    RunConfig, the run checks: `problems_of`), and each refused one has one."""
    cases = VALID + EXIT2 + random_valid_cases(40, 3, DIMS)
    rng = random.Random(5)
    cases += [{d: rng.choice(v) for d, v in DIMS.items()} for _ in range(200)]
    for c in cases:
        if world(c) > MAX_WORLD:
            continue
        problems = problems_of(c)
        assert bool(problems) == bool(refusals(c)), (describe(c), problems, refusals(c))
    assert {name for name, _, _ in RULES} == {r for c in EXIT2 for r in refusals(c)}
    for c in cases:  # what pairwise.possible's pruned search relies on
        for d in RULE_FREE:
            assert all(refusals({**c, d: v}) == refusals(c) for v in DIMS[d]), (d, describe(c))


@pytest.fixture(scope="module")
def data():
    return prepare_data()


def test_exit2_cases_are_refused_naming_the_offending_values(data):
    for c in EXIT2:
        ok, message = check_exit2(c, data, expected_messages(c))
        assert ok, (describe(c), message)


@pytest.fixture(scope="module")
def verdicts(data):
    for c in CASES:
        assert not isinstance(spec_of(c, data)[0], int), describe(c)  # the CLI accepts it
    alone = tuple(i for i, n in enumerate(NAMES) if n in XFAIL)
    return run_matrix(CASES, data, alone)


def _param(i: int, name: str):
    marks = [pytest.mark.xfail(strict=True, reason=XFAIL[name])] if name in XFAIL else []
    return pytest.param(i, id=name, marks=marks)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("i", [_param(i, n) for i, n in enumerate(NAMES)])
def test_matrix_case_equals_the_one_process_run(verdicts, i):
    v = verdicts[i]
    assert v["ok"], (f"{v['name']}: {v['message']} ({v['metric']} off by {v['dev']:.2e}, bound "
                     f"{v['bound']:.0e})\n  mini3d train " + " ".join(v["flags"]))
