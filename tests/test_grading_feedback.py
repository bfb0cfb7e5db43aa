"""What a learner reads when an answer is wrong or unfinished: hard cases always graded, failures that
name the rank / chunk / step, mini3d's own check() under a wrong schedule, the stub's hint, every
check's points, and the grade cell that ends each chapter (which must never raise).

The wrong answers live in tests/fixtures/: `torch_chunk` (ring chunks cut with torch.chunk, right
whenever the size splits into n pieces) and `reversed_warmup` (1F1B warm-up counted from the wrong
end, which deadlocks).
"""

from __future__ import annotations

import random

import pytest

from mini3d.cli import main
from mini3d.course import grading
from mini3d.course.grading import pipeline
from mini3d.course.grading.notebook import grade_exercise


def _seeds_by_world(n_each: int = 1) -> list[int]:
    """Grading seeds whose ring_allreduce run has 3 ranks and 4 ranks, `n_each` of each: the hard
    sizes (n + 1, n - 1) are fixed per world size, so covering both sizes covers every seed."""
    ring = grading.find(["ring_allreduce"])[0]
    by = {3: [], 4: []}
    for seed in range(100):
        n = ring.world(random.Random(f"{seed}:ring_allreduce:world"))
        if len(by[n]) < n_each:
            by[n].append(seed)
    return by[3] + by[4]


@pytest.mark.timeout(400)
def test_torch_chunk_ring_fails_uneven_on_every_seed(capsys):
    """`mini3d grade ring_allreduce` on the torch.chunk answer: the uneven check fails on every seed
    (3 and 4 ranks), and only it; the message names the rank and the chunk."""
    for seed in _seeds_by_world():
        assert main(["grade", "--impl", "tests.fixtures.torch_chunk", "--seed", str(seed), "ring_allreduce"]) == 1
        out = capsys.readouterr().out
        assert "[0/2] FAIL  uneven" in out, out
        fails = [line for line in out.splitlines() if " FAIL " in line]
        assert len(fails) == 1, out
        assert "rank " in out and "chunk " in out and "7/9" in out


def test_m_smaller_than_pp_is_always_graded():
    for seed in range(30):
        meshes = pipeline._meshes(random.Random(seed))
        assert any(m < pp for pp, m in meshes), meshes
        assert any(m >= pp + 1 for pp, m in meshes)


@pytest.mark.timeout(60)
def test_wrong_schedules_show_mini3d_check():
    swapped = grading.grade("tests.fixtures.wrong_answers", ["one_f_one_b"], seed=3)
    msg = next(o.message for o in swapped if not o.earned)
    assert "first difference at step" in msg and "mini3d's check()" in msg and "rank 0:" in msg
    deadlock = grading.grade("tests.fixtures.reversed_warmup", ["one_f_one_b"], seed=3)
    failed = {o.check: o.message for o in deadlock if not o.earned}
    assert {"warmup", "exact_order"} <= set(failed)
    assert "deadlock at rank" in failed["warmup"] and "blocks receiving" in failed["warmup"]


def test_stub_hint_is_shown_without_starting_processes():
    ring = grading.find(["ring_allreduce"])[0]
    out = grading.run_check(ring, ring.checks[0], "exercises", seed=1)
    assert out.earned == 0 and "start with ring_all_reduce()" in out.message
    assert "split tensor.view(-1)" in out.message  # the stub's own hint, not a generic sentence


@pytest.mark.timeout(60)
def test_score_table_prints_every_check_pass_or_fail(capsys):
    assert main(["grade", "--impl", "tests.fixtures.wrong_answers", "--seed", "5", "one_f_one_b"]) == 1
    out = capsys.readouterr().out
    assert "[2/2] pass  each_once" in out and "[0/3] FAIL  exact_order" in out


@pytest.mark.timeout(60)
def test_grade_cell_never_raises_and_prints_points(capsys):
    grade_exercise("count_params", "one_f_one_b")  # the stubs in exercises/: 0 points, hints
    out = capsys.readouterr().out
    assert "count_params (chapter 00" in out and "0/5 points" in out and "0/10 points" in out
    assert out.count("FAIL") == 3 + 5 and "not implemented yet (" in out
    grade_exercise("one_f_one_b", impl="solutions", seed=2)
    out = capsys.readouterr().out
    assert "10/10 points" in out and out.count(" pass ") == 5 and "--seed 2 one_f_one_b" in out
    grade_exercise("no_such_exercise")
    assert "cannot grade" in capsys.readouterr().out
