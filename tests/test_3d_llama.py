"""The llama family (RMSNorm, rotary positions, SwiGLU, grouped-query attention, a tied head) in
tp x pp x dp layouts equals its single-process reference, as tests/test_3d.py shows for the GPT.

One 8-process gloo job runs every layout (tests/threed_workers.run_layouts; shared with
tests/test_3d.py: tests/conftest.py `eight_rank_job`). The head is tied to
the embedding, so the pipeline layouts hold the matrix on two stages and must sum its gradient
across them (mini3d.pp.tied); tp=2 splits the 2 key/value heads one per rank. The llama layouts
run in float64 with test_3d's F64 bounds (summation order only), explained there. A two-stage gpt2-family run with
a tied head (learned positions, biases, tanh GELU) checks that family's tie the same way.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mini3d.config import ModelConfig, Plan
from mini3d.launch.launcher import launch
from tests.test_3d import F64, F64_BASE, SEED, SHARED_LAUNCH_TIMEOUT, STEPS, check_float32, reference
from tests.threed_workers import run_layouts

LLAMA = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=256, max_seq_len=32, d_ff=48,
                    family="llama", n_kv_heads=2, rope_base=500000.0, tie_embeddings=True)

CASES = [  # every case uses the same 8 ranks
    ("llama-tp2-pp2-dp2-zero1-1f1b-sp", Plan(tp=2, pp=2, dp=2, zero=1, micro_batches=4,
                                             sequence_parallel=True, **F64_BASE)),
    ("llama-tp2-pp1-dp4-zero3-selective", Plan(tp=2, dp=4, zero=3, micro_batches=2,
                                               recompute="selective", **F64_BASE)),
    ("llama-tp1-pp2-dp4-interleaved-zero2-full", Plan(pp=2, dp=4, zero=2, schedule="interleaved",
                                                      virtual_stages=2, micro_batches=2,
                                                      recompute="full", **F64_BASE)),
    ("llama-tp2-pp2-dp2-zero0-gpipe-sdpa", Plan(tp=2, pp=2, dp=2, schedule="gpipe", micro_batches=2,
                                                attention="sdpa", **F64_BASE)),
]
CLIP = 0.5  # the reference's norms are larger: every step clips
CLIPPED = ("llama-tp2-pp2-dp2-zero1-clip", Plan(tp=2, pp=2, dp=2, zero=1, micro_batches=4,
                                                **F64_BASE))


# this module's part of the shared 8-rank launch (tests/conftest.py eight_rank_job)
EIGHT_RANK_LAYOUTS = ([{"name": n, "plan": dataclasses.asdict(p)} for n, p in CASES]
                      + [{"name": CLIPPED[0], "plan": dataclasses.asdict(CLIPPED[1]), "grad_clip": CLIP}],
                      dataclasses.asdict(LLAMA))
EIGHT_RANK_TIMEOUT = 220


@pytest.mark.timeout(SHARED_LAUNCH_TIMEOUT)
def test_llama_layouts_equal_the_reference(eight_rank_job):
    results = eight_rank_job[__name__]
    ref = reference(STEPS, cfg=LLAMA, dtype=torch.float64)
    assert "head.out.weight" not in ref[1][0]  # tied: one matrix, its gradient from both uses
    for name, plan in CASES:
        losses = {tuple(r["losses"]) for per_rank in results for r in per_rank if r["name"] == name}
        assert len(losses) == 1, (name, losses)
        assert list(losses.pop()) == pytest.approx(ref[0], abs=F64["loss"]), name
        check_float32(name, plan, results, ref, cfg=LLAMA, bounds=F64)
    # --grad-clip: the global norm counts the tied matrix once, although two stages hold it
    norms = []
    clipped = reference(STEPS, CLIP, norms, cfg=LLAMA, dtype=torch.float64)
    assert min(norms) > 2 * CLIP
    for r in (r for per_rank in results for r in per_rank if r["name"] == CLIPPED[0]):
        assert r["norms"] == pytest.approx(norms, rel=1e-10), (r["norms"], norms)
    check_float32(CLIPPED[0], CLIPPED[1], results, clipped, cfg=LLAMA, bounds=F64)


def test_tp_must_divide_the_key_value_heads():
    problems = Plan(tp=4, global_batch=8, seq_len=16).problems(LLAMA, 4)
    assert any("tp=4 does not divide n_kv_heads=2" in p and "[1, 2]" in p for p in problems), problems
    assert not Plan(tp=2, global_batch=8, seq_len=16).problems(LLAMA, 2)


GPT2_TIED = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=256, max_seq_len=32,
                        activation="gelu_tanh", tie_embeddings=True)


@pytest.mark.timeout(120)
def test_gpt2_with_a_tied_head_across_two_stages_equals_the_reference():
    """The gpt2 family (learned positions, biases, tanh GELU) with its head tied across pp=2."""
    name, plan = "gpt2-tied-pp2", Plan(pp=2, micro_batches=2, **F64_BASE)
    results = launch(run_layouts, 2, [{"name": name, "plan": dataclasses.asdict(plan)}],
                     dataclasses.asdict(GPT2_TIED), STEPS, SEED, device="cpu", timeout=100)
    ref = reference(STEPS, cfg=GPT2_TIED, dtype=torch.float64)
    for per_rank in results:
        for r in per_rank:
            assert r["losses"] == pytest.approx(ref[0], abs=F64["loss"])
    check_float32(name, plan, results, ref, cfg=GPT2_TIED, bounds=F64)


def test_dropout_is_available_off_by_default_and_refused_with_tp():
    import torch

    from mini3d.models.transformer import GPT

    x = torch.randint(0, 256, (2, 16))
    model = GPT(ModelConfig(dropout=0.2))
    assert not torch.equal(model(x), model(x))  # training mode: fresh masks
    model.eval()
    assert torch.equal(model(x), model(x))
    plain = GPT(ModelConfig())
    assert torch.equal(plain(x), plain(x))  # p=0 by default
    assert any("dropout=0.2" in p for p in Plan(tp=2, seq_len=16).problems(ModelConfig(dropout=0.2)))
