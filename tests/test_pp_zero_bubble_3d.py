"""The new pipeline schedules inside tp x pp x dp layouts equal the single-process reference.

One 8-process gloo job (tests/threed_workers.run_layouts, shared with tests/test_3d.py:
tests/conftest.py `eight_rank_job`) trains every layout below for 3 AdamW
steps in float64 (Plan dtype "float64", against the reference in float64): the layouts differ from
the reference in summation order only, so test_3d's tight F64 bounds (1e-10; see the comment above
it) hold on any machine, where float32's 3e-4 once failed on an AMD EPYC (3.06e-4, tp2-pp4-
interleaved-m6, from float32 summation order alone). The model has 8 layers so that
zbv at pp=4 has its 8 chunks. Covered, in few layouts because 8-process jobs are slow on CI: zb-h1
and zbv at pp=2 under tp2 x dp2 ZeRO-1 (the dp gradient sync runs in each chunk's last W), zb-h1
at pp=4 under tp2 with full recomputation (recomputed in B, kept for W), zbv at pp=4 under dp2
ZeRO-1, zbv with sequence parallelism and selective recomputation, and interleaved with m not a
multiple of p (pp=4, m=6, PyTorch's relaxation). Looped BFS (plain F/B, no new runtime path) is
checked alone at pp=2 and pp=4 in tests/test_pp_runtime.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mini3d.config import ModelConfig, Plan
from tests.test_3d import BASE, F64, SHARED_LAUNCH_TIMEOUT, STEPS, check_float32, reference

CFG = ModelConfig(n_layers=8, d_model=32, n_heads=4, vocab_size=256, max_seq_len=32)
BASE = {**BASE, "dtype": "float64"}
CASES = [
    ("tp2-pp2-dp2-zero1-zb-h1", Plan(tp=2, pp=2, dp=2, zero=1, schedule="zb-h1", micro_batches=4,
                                     **BASE)),
    ("tp2-pp4-zb-h1-full", Plan(tp=2, pp=4, schedule="zb-h1", micro_batches=4, recompute="full",
                                **BASE)),
    ("tp2-pp2-dp2-zero1-zbv-sp-selective", Plan(tp=2, pp=2, dp=2, zero=1, schedule="zbv",
                                                virtual_stages=2, micro_batches=4,
                                                sequence_parallel=True, recompute="selective",
                                                **BASE)),
    ("tp1-pp4-dp2-zero1-zbv", Plan(pp=4, dp=2, zero=1, schedule="zbv", virtual_stages=2,
                                   micro_batches=4, **BASE)),
    ("tp2-pp4-interleaved-m6", Plan(tp=2, pp=4, schedule="interleaved", virtual_stages=2,
                                    micro_batches=6, **{**BASE, "global_batch": 12})),
]


# this module's part of the shared 8-rank launch (tests/conftest.py eight_rank_job)
EIGHT_RANK_LAYOUTS = ([{"name": n, "plan": dataclasses.asdict(p)} for n, p in CASES],
                      dataclasses.asdict(CFG))
EIGHT_RANK_TIMEOUT = 280


def test_new_schedules_fit_8_ranks():
    for _, plan in CASES:
        assert plan.problems(CFG, 8) == [], plan


@pytest.mark.timeout(SHARED_LAUNCH_TIMEOUT)
def test_new_schedules_in_3d_layouts_equal_the_reference(eight_rank_job):
    results = eight_rank_job[__name__]
    refs = {gb: reference(STEPS, cfg=CFG, global_batch=gb, dtype=torch.float64)
            for gb in {p.global_batch for _, p in CASES}}
    for name, plan in CASES:
        ref = refs[plan.global_batch]
        losses = {tuple(r["losses"]) for per_rank in results for r in per_rank if r["name"] == name}
        assert len(losses) == 1, (name, losses)
        assert list(losses.pop()) == pytest.approx(ref[0], abs=F64["loss"]), name
        check_float32(name, plan, results, ref, cfg=CFG, bounds=F64)
