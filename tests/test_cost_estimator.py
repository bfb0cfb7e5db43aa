"""Memory estimator: exact parameter counts, ZeRO byte accounting, activations vs. the paper."""

import dataclasses

import pytest

from mini3d.config import PRESETS, ModelConfig, Plan
from mini3d.cost.activations import (inflight_microbatches, layer_activation_bytes,
                                     paper_layer_activation_bytes)
from mini3d.cost.memory import (estimate_all_stages, estimate_memory, model_state_bytes, state_bytes,
                                stage_layers, stage_param_count)
from mini3d.models.transformer import GPT


@pytest.mark.timeout(30)
def test_zero_model_states_of_7_5b_on_64_gpus():
    # ZeRO paper, Figure 1: Psi = 7.5e9, Nd = 64, mixed-precision Adam (K = 12): 120 / 31.4 / 16.6 / 1.9 GB
    # the paper's accounting has half-precision gradients: grad_dtype="bf16"
    got = [round(sum(model_state_bytes(7.5e9, "bf16", 64, z, "bf16")) / 1e9, 1) for z in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]
    # mini3d's default keeps fp32 gradients: 18 bytes per parameter (state_bytes, the one rule)
    assert sum(state_bytes("bf16")) == 18 and sum(state_bytes("bf16", "bf16")) == 16
    assert sum(model_state_bytes(7.5e9, "bf16", 64, 0)) == 18 * 7.5e9
    assert model_state_bytes(1000, "float32", 4, 0) == (4000, 4000, 8000)
    assert model_state_bytes(1000, "float32", 4, 2) == (4000, 1000, 2000)


@pytest.mark.timeout(60)
def test_stage_parameter_counts_match_the_real_model():
    cfg = ModelConfig(5, 32, 4, 97, 16)  # 5 layers: uneven split over 2 and 3 stages
    for pp in (1, 2, 3):
        plan = Plan(pp=pp)
        for s in range(pp):
            m = GPT(cfg, 0, layers=stage_layers(cfg, plan, s), first=s == 0, last=s == pp - 1)
            assert stage_param_count(cfg, plan, s) == sum(p.numel() for p in m.parameters())
    # interleaved chunks: rank r holds chunks r, r + pp, ...; every layer exactly once
    plan = Plan(pp=2, virtual_stages=2, schedule="interleaved", micro_batches=2)
    cfg8 = dataclasses.replace(cfg, n_layers=8)
    assert stage_layers(cfg8, plan, 0) == [0, 1, 4, 5] and stage_layers(cfg8, plan, 1) == [2, 3, 6, 7]
    # tp=2: split matrices halve; LayerNorms, row-parallel biases and positions are replicated;
    # the vocabulary 97 is padded to 98 for the embedding and the head
    h, V = cfg.d_model, 97
    replicated = cfg.n_layers * (4 * h + 2 * h) + cfg.max_seq_len * h + 2 * h
    padding = 2 * (98 - V) * h
    total = stage_param_count(cfg, Plan(tp=2), 0)
    assert 2 * total == cfg.n_params() + padding + replicated


@pytest.mark.timeout(30)
def test_activation_adaptation_differs_from_the_paper_by_the_documented_terms():
    cfg = ModelConfig(2, 256, 8, 100, 512)
    s, b, h, a = 512, 2, cfg.d_model, cfg.n_heads
    for tp, sp in ((1, False), (4, False), (4, True)):
        plan = Plan(tp=tp, seq_len=s, global_batch=b, dtype="bf16", sequence_parallel=sp)
        mine = layer_activation_bytes(cfg, plan, fused_attention=False)["stored"]
        # added back: two 1-byte dropout masks (sbh, replicated unless sp), the softmax dropout mask
        # (as^2b) and the dropout output (2as^2b); split over tp like the rest of the core
        masks = 2 * s * b * h / (tp if sp or tp == 1 else 1) + 3 * a * s * s * b / tp
        assert mine + masks == pytest.approx(paper_layer_activation_bytes(s, b, h, a, tp, sp))
        sel = layer_activation_bytes(cfg, plan, recompute="selective")["stored"]
        sel_masks = 2 * s * b * h / (tp if sp or tp == 1 else 1)
        assert sel + sel_masks == pytest.approx(
            paper_layer_activation_bytes(s, b, h, a, tp, sp, "selective"))
        full = layer_activation_bytes(cfg, plan, recompute="full")["stored"]
        assert full == pytest.approx(paper_layer_activation_bytes(s, b, h, a, tp, sp, "full"))
    # the fused kernel keeps an fp32 log-sum-exp instead of the s x s probabilities (its output is
    # the projection's input, counted either way)
    plan = Plan(seq_len=512, global_batch=2, dtype="bf16")
    diff = (layer_activation_bytes(cfg, plan)["stored"]  # mini3d's model: the written-out core
            - layer_activation_bytes(cfg, plan, fused_attention=True)["stored"])
    assert diff == a * s * s * b * 2 - 4 * a * s * b
    assert layer_activation_bytes(cfg, plan.replace(attention="sdpa")) == \
        layer_activation_bytes(cfg, plan, fused_attention=True)


@pytest.mark.timeout(30)
def test_in_flight_micro_batches_and_the_heaviest_stage():
    p, m, v = 4, 8, 2
    one = Plan(pp=p, micro_batches=m, global_batch=m)
    assert [inflight_microbatches(one, s) for s in range(p)] == [4, 3, 2, 1]
    assert inflight_microbatches(one.replace(schedule="gpipe"), 3) == m
    il = one.replace(schedule="interleaved", virtual_stages=v)
    # Korthikanti et al. sec. 4.2.3: the first rank holds p * (1 + (p-1)/(p*v)) micro-batches' worth
    assert inflight_microbatches(il, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    cfg = dataclasses.replace(PRESETS["gpt-1.3b"], vocab_size=256)  # small head: stage 0 dominates
    plan = Plan(pp=p, micro_batches=m, global_batch=m, seq_len=1024, dtype="bf16")
    stages = estimate_all_stages(cfg, plan)
    acts = [e.activations for e in stages]
    assert acts == sorted(acts, reverse=True) and acts[0] > 3 * acts[-1]
    worst = estimate_memory(cfg, plan)
    assert worst.stage == 0 and worst.total == max(e.total for e in stages)
    assert worst.total == sum(worst.as_dict()[k] for k in
                              ("params", "grads", "optimizer", "activations", "comm_buffers"))
    assert worst.fits(worst.total) and not worst.fits(worst.total - 1)
    # recompute and ZeRO shrink what they should, and only that
    full = estimate_memory(cfg, plan.replace(recompute="full"))
    assert full.activations < worst.activations / 5 and full.params == worst.params
    z1 = estimate_memory(cfg, plan.replace(pp=1, dp=4, zero=1, micro_batches=2, schedule="1f1b"))
    z0 = estimate_memory(cfg, plan.replace(pp=1, dp=4, zero=0, micro_batches=2, schedule="1f1b"))
    assert z1.optimizer * 4 == pytest.approx(z0.optimizer, rel=1e-9) and z1.grads == z0.grads
