"""The llama family (RMSNorm, rotary positions, SwiGLU, grouped-query attention, a tied head) in
tp x pp x dp layouts equals its single-process reference, as tests/test_3d.py shows for the GPT.

One 8-process gloo job runs every layout (tests/threed_workers.run_layouts). The head is tied to
the embedding, so the pipeline layouts hold the matrix on two stages and must sum its gradient
across them (mini3d.pp.tied); tp=2 splits the 2 key/value heads one per rank. The tolerances are
test_3d's float32 ones (summation order only), explained there.
"""

from __future__ import annotations

import dataclasses

import pytest

from mini3d.config import ModelConfig, Plan
from mini3d.launch import launch
from tests.test_3d import BASE, SEED, STEPS, check_float32, reference
from tests.threed_workers import run_layouts

LLAMA = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=256, max_seq_len=32, d_ff=48,
                    family="llama", n_kv_heads=2, rope_base=500000.0, tie_embeddings=True)

CASES = [  # every case uses the same 8 ranks
    ("llama-tp2-pp2-dp2-zero1-1f1b-sp", Plan(tp=2, pp=2, dp=2, zero=1, micro_batches=4,
                                             sequence_parallel=True, **BASE)),
    ("llama-tp2-pp1-dp4-zero3-selective", Plan(tp=2, dp=4, zero=3, micro_batches=2,
                                               recompute="selective", **BASE)),
    ("llama-tp1-pp2-dp4-interleaved-zero2-full", Plan(pp=2, dp=4, zero=2, schedule="interleaved",
                                                      virtual_stages=2, micro_batches=2,
                                                      recompute="full", **BASE)),
    ("llama-tp2-pp2-dp2-zero0-gpipe-sdpa", Plan(tp=2, pp=2, dp=2, schedule="gpipe", micro_batches=2,
                                                attention="sdpa", **BASE)),
]


@pytest.mark.timeout(240)
def test_llama_layouts_equal_the_reference():
    cases = [{"name": n, "plan": dataclasses.asdict(p)} for n, p in CASES]
    results = launch(run_layouts, 8, cases, dataclasses.asdict(LLAMA), STEPS, SEED, device="cpu",
                     timeout=220)
    ref = reference(STEPS, cfg=LLAMA)
    assert "head.out.weight" not in ref[1][0]  # tied: one matrix, its gradient from both uses
    for name, plan in CASES:
        losses = {tuple(r["losses"]) for per_rank in results for r in per_rank if r["name"] == name}
        assert len(losses) == 1, (name, losses)
        assert list(losses.pop()) == pytest.approx(ref[0], abs=1e-5), name
        check_float32(name, plan, results, ref, cfg=LLAMA)


def test_tp_must_divide_the_key_value_heads():
    problems = Plan(tp=4, global_batch=8, seq_len=16).problems(LLAMA, 4)
    assert any("tp=4 does not divide n_kv_heads=2" in p and "[1, 2]" in p for p in problems), problems
    assert not Plan(tp=2, global_batch=8, seq_len=16).problems(LLAMA, 2)
