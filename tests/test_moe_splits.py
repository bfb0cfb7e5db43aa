"""MoE layers under tp, sequence parallelism, pp (every schedule, dense-only stages), cp, ZeRO-3,
recomputation, bf16 and clipping, and expert parallelism composed with them (ep x cp, ep x tp x sp,
ep x pp, ep x recompute (full, selective), ep x bf16, ep x ZeRO-3 x bf16 on edp = 2,
ep x tp x pp x ZeRO-1: the issue's layout), equal the one-process MoE run: losses, every
gradient of every step (gathered to full shape, captured just before the inner AdamW step: after the
dp / tp / pp syncs and clipping), the per-step expert load report, and the aux-loss-free biases,
over 3 steps.

One launch per world size runs all its cases in turn (tests/moe_workers.run_moe_cases), and one
1-rank launch the deduplicated references: the same `Trainer` with tp = pp = dp = cp = 1, the
case's model, clipping and dtype, and dp x micro_batches micro-batches (the router losses are
per micro-batch: the reference must see the same micro-batches, which dp's slices of the global
batch are, in order). The routed experts are not tensor-split (see mini3d/tp/parallelize.py),
except in the `expert-tp` cases (`--expert-tp`, mini3d/tp/experts.py: tp, tp x sp with full
recomputation, tp x pp x sp, tp x dp x ZeRO-3, tp x dp x ep x ZeRO-1 with clipping,
tp x sp x dp x ep x ZeRO-2, tp in bf16), which also check that the checkpoint's state holds the
full experts (equal to the one-process run's) and restores them. (bf16 is checked on the gpt2 model without sp: with this llama model under tp2 x
sp, with or without ep, a few near-tie tokens move the last router's bf16 gradient by 57 % at
step 3 with the experts whole as with --expert-tp, past the bounds below, while float64 agrees to
1e-15.)

Bounds. float64 (cases and references in float64): the layouts differ in summation order only
(tp / dp / cp reductions, micro-batch sums), ~1e-16 relative an op; losses 1e-10 absolute,
gradients 1e-9 of each tensor's largest entry (measured ~1e-15; the router's top-k sees the same
logits to 1e-15 and picks the same experts). A missed tp sum (sequence parallelism), a cp
average left undone, a stage's router loss dropped or counted twice moves them by 1e-3 or more.
bf16 against the one-process bf16 run (float32 gradients): tests/test_3d.py's BF16 bounds,
losses 1e-2 absolute and 3 % on the norm of each step's gradient error relative to the
reference's norm, and per tensor: 10 % of its norm, 35 % for the routers' and routed experts'.
Why those: with dp only (the same bf16 ops, micro-batch sums in another order) every tensor
agrees to 3e-7; with tp x cp x sp the activations are rounded after other reductions, a few
tokens whose top-2 is a near-tie pick another expert, and the gradients of the experts and of
the router move with the tokens each expert gets (measured: up to 24 % of a layer's expert
tensors, 11 % of a router, the global norm < 3 %). A gradient off by a factor 2 (a double
count) is 100 % off, a missing tp sum 50 %. A layout that splits no token's computation (dp
and ep only: the same bf16 ops on the same rows; ep only runs an expert's rows of the whole ep
group as one matmul) is held tighter at the first step, where both runs start from the same
weights: every tensor within 1 % (measured: 2e-3 on the expert weights, bf16's 2^-8 rounding
of their gradients summed over other row groupings, 2e-11 elsewhere), so a wrong scale (a
missing 1/ep on the expert gradients: 100 %) or a 2 % slip fails it; later steps take the
bounds above (their bf16 weights have drifted apart: up to 9 % measured on an expert tensor).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mini3d.config import ModelConfig, Plan
from mini3d.launch.launcher import launch
from tests.moe_workers import run_moe_cases

# 4 layers, the first dense (a dense-only pipeline stage with two chunks a rank, interleaved),
# the others MoE with a shared expert; per-layer balancing loss (the one pp can carry) and z-loss
CFG = ModelConfig(n_layers=4, d_model=32, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=16,
                  d_ff=64, family="llama", n_experts=4, top_k=2, moe_ffn=32, n_shared_experts=1,
                  dense_layers=1, aux_loss_coef=0.01, z_loss_coef=1e-3, aux_loss_scope="layer",
                  name="moe-splits")
POOLED = dataclasses.replace(CFG, aux_loss_scope="model", capacity_factor=1.25,
                             family="gpt2", n_kv_heads=4)  # tp without sp: capacity and pooling
SIGMOID = dataclasses.replace(CFG, router="sigmoid", router_bias_rate=1e-3)
DENSE_STAGE = dataclasses.replace(CFG, dense_layers=2)  # pp=2: stage 0 holds no MoE layer
STEPS, SEED, CLIP = 3, 5, 0.05  # the clip binds (norms ~1.5)
# ---- deepseek (issue #31): MLA, the grouped sigmoid router (8 experts in 4 groups, the best 2
# a token; scaling 2.5; the aux-loss-free bias), a shared expert, a dense first layer and the
# sequence-wise balance loss (pooled over sp / cp like the others; per layer under pp)
DEEPSEEK = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=256, max_seq_len=16, d_ff=64,
                       family="deepseek", q_lora_rank=12, kv_lora_rank=8, qk_rope_dim=4,
                       qk_nope_dim=6, v_head_dim=5, rope_interleave=True, n_experts=8, top_k=2,
                       moe_ffn=16, n_shared_experts=1, dense_layers=1, router="sigmoid",
                       route_groups=4, route_topk_groups=2, routed_scaling_factor=2.5,
                       router_bias_rate=1e-3, seq_aux_loss_coef=0.01, name="moe-splits-deepseek")
DEEPSEEK_CASES = {
    2: [("deepseek-tp2-sp", DEEPSEEK, dict(tp=2, sequence_parallel=True, micro_batches=2), 0.0),
        ("deepseek-cp2-ep2", DEEPSEEK, dict(cp=2, ep=2, micro_batches=2), 0.0),
        ("deepseek-dp2-ep2-clip", DEEPSEEK, dict(dp=2, ep=2, micro_batches=2), CLIP)],
    4: [("deepseek-tp2-cp2-sp-ep2-zero1", DEEPSEEK, dict(tp=2, cp=2, sequence_parallel=True, ep=2,
                                                      zero=1, micro_batches=2), 0.0)],
    8: [("deepseek-tp2-pp2-dp2-ep2", DEEPSEEK, dict(tp=2, pp=2, dp=2, ep=2, micro_batches=2), 0.0)],
}
# ---- end of deepseek

BF16 = dict(loss=1e-2, grad=0.03, tensor=0.1, routed=0.35, first=0.01)  # see the module docstring
BASE = dict(global_batch=8, seq_len=16, bucket_mb=0.01, dtype="float64")

# (name, model, plan changes, grad_clip)
CASES = {
    2: [("tp2-pooled-capacity", POOLED, dict(tp=2, micro_batches=2), 0.0),
        ("tp2-sp-recompute-full", CFG, dict(tp=2, sequence_parallel=True, recompute="full"), 0.0),
        ("tp2-sp-selective-clip", CFG, dict(tp=2, sequence_parallel=True, recompute="selective",
                                            micro_batches=2), CLIP),
        ("cp2", CFG, dict(cp=2, micro_batches=2), 0.0),
        ("dp2-zero3-sigmoid", SIGMOID, dict(dp=2, zero=3, micro_batches=2), 0.0),
        ("pp2-gpipe", CFG, dict(pp=2, schedule="gpipe", micro_batches=2), 0.0),
        ("pp2-1f1b-dense-stage", DENSE_STAGE, dict(pp=2, schedule="1f1b", micro_batches=2), 0.0),
        ("pp2-interleaved", CFG, dict(pp=2, schedule="interleaved", virtual_stages=2,
                                      micro_batches=2), 0.0),
        ("pp2-looped-bfs", CFG, dict(pp=2, schedule="looped-bfs", virtual_stages=2,
                                     micro_batches=2), 0.0),
        ("pp2-zb-h1-clip", CFG, dict(pp=2, schedule="zb-h1", micro_batches=2), CLIP),
        ("pp2-zbv-recompute-full", CFG, dict(pp=2, schedule="zbv", virtual_stages=2,
                                             micro_batches=2, recompute="full"), 0.0),
        ("dp2-zero1-bf16", CFG, dict(dp=2, zero=1, micro_batches=2, dtype="bf16"), CLIP),
        ("cp2-ep2-clip", CFG, dict(cp=2, ep=2, micro_batches=2), CLIP),
        ("dp2-ep2-recompute-full-clip", CFG, dict(dp=2, ep=2, recompute="full", micro_batches=2),
         CLIP),
        ("dp2-ep2-zero1-recompute-selective", CFG, dict(dp=2, ep=2, zero=1,
                                                        recompute="selective"), 0.0),
        ("dp2-ep2-bf16", CFG, dict(dp=2, ep=2, micro_batches=2, dtype="bf16"), 0.0),
        ("tp2-expert-tp-pooled-capacity-clip", POOLED, dict(tp=2, expert_tp=True, micro_batches=2),
         CLIP),
        ("tp2-sp-expert-tp-recompute-full", CFG, dict(tp=2, sequence_parallel=True, expert_tp=True,
                                                      recompute="full"), 0.0),
        ("tp2-expert-tp-pooled-bf16", POOLED, dict(tp=2, expert_tp=True, micro_batches=2,
                                                   dtype="bf16"), 0.0)],
    4: [("tp2-pp2-sp-zb-h1-sigmoid", SIGMOID, dict(tp=2, pp=2, sequence_parallel=True,
                                                   schedule="zb-h1", micro_batches=2), 0.0),
        ("cp2-dp2-zero3-clip", CFG, dict(cp=2, dp=2, zero=3), CLIP),
        ("tp2-cp2-sp-bf16", CFG, dict(tp=2, cp=2, sequence_parallel=True, micro_batches=2,
                                      dtype="bf16"), 0.0),
        ("tp2-sp-dp2-ep2-zero2-clip", CFG, dict(tp=2, sequence_parallel=True, dp=2, ep=2, zero=2,
                                                micro_batches=2), CLIP),
        ("pp2-dp2-ep2-interleaved-sigmoid", SIGMOID, dict(pp=2, dp=2, ep=2, schedule="interleaved",
                                                          virtual_stages=2, micro_batches=2), 0.0),
        ("cp2-dp2-ep4-zero1", CFG, dict(cp=2, dp=2, ep=4, zero=1, micro_batches=2), 0.0),
        ("dp4-ep2-zero3-bf16-clip", CFG, dict(dp=4, ep=2, zero=3, dtype="bf16"), CLIP),
        ("tp2-dp2-ep2-expert-tp-zero1-clip", CFG, dict(tp=2, dp=2, ep=2, zero=1, expert_tp=True,
                                                       micro_batches=2), CLIP),
        ("tp2-sp-dp2-ep2-expert-tp-zero2", CFG, dict(tp=2, sequence_parallel=True, dp=2, ep=2,
                                                     zero=2, expert_tp=True), 0.0),
        ("tp2-dp2-zero3-expert-tp-sigmoid-clip", SIGMOID, dict(tp=2, dp=2, zero=3, expert_tp=True,
                                                               micro_batches=2), CLIP),
        ("tp2-pp2-sp-expert-tp-1f1b", CFG, dict(tp=2, pp=2, sequence_parallel=True, expert_tp=True,
                                                schedule="1f1b", micro_batches=2), 0.0)],
    8: [("tp2-pp2-dp2-ep2-zero1-clip", CFG, dict(tp=2, pp=2, dp=2, ep=2, zero=1, micro_batches=2),
         CLIP)],
}
for _n, _cs in DEEPSEEK_CASES.items():  # deepseek's cases join the launches of their world size
    CASES[_n] = CASES[_n] + _cs


def _case(name, cfg, changes, clip):  # expert-tp cases also check the checkpoint's full state
    return {"name": name, "cfg": cfg.__dict__, "plan": {**BASE, **changes}, "grad_clip": clip,
            "state": bool(changes.get("expert_tp"))}


def _reference_of(case: dict) -> dict:
    p = case["plan"]
    m = p.get("dp", 1) * p.get("micro_batches", 1)
    return {"name": "ref", "cfg": case["cfg"], "grad_clip": case["grad_clip"], "state": True,
            "plan": {**BASE, "dtype": p["dtype"], "micro_batches": m}}


def _key(ref: dict) -> str:
    return repr((sorted(ref["cfg"].items()), ref["grad_clip"], sorted(ref["plan"].items())))


@pytest.fixture(scope="module")
def runs():
    cases = {n: [_case(*c) for c in cs] for n, cs in CASES.items()}
    refs = {_key(r): r for cs in cases.values() for r in map(_reference_of, cs)}
    ref_out = launch(run_moe_cases, 1, list(refs.values()), STEPS, SEED, device="cpu",
                     timeout=300)[0]
    ref_by_key = dict(zip(refs, ref_out))
    got = {n: launch(run_moe_cases, n, cs, STEPS, SEED, device="cpu", timeout=500)
           for n, cs in cases.items()}
    out = {}
    for n, cs in cases.items():
        for i, c in enumerate(cs):
            out[c["name"]] = ([per_rank[i] for per_rank in got[n]], ref_by_key[_key(_reference_of(c))],
                              c)
    return out


def _merged(ranks: list[dict], step: int) -> dict:
    """One step's full gradients of every stage (each pp rank's reporter holds its stages')."""
    out = {}
    for r in ranks:
        if "grads" in r:
            assert not set(out) & set(r["grads"][step])  # each parameter on one stage
            out.update(r["grads"][step])
    return out


NAMES = [c[0] for cs in CASES.values() for c in cs]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", NAMES)
def test_moe_layout_equals_the_one_process_run(runs, name):
    ranks, ref, case = runs[name]
    bf16 = case["plan"]["dtype"] == "bf16"
    reporters = [r for r in ranks if "losses" in r]
    assert len(reporters) == case["plan"].get("pp", 1)
    for r in reporters:  # the loss (every pp rank) and the load report (all stages, all ranks)
        assert r["losses"] == pytest.approx(ref["losses"], abs=BF16["loss"] if bf16 else 1e-10)
        if not bf16:
            assert r["loads"] == ref["loads"]
    assert ref["loads"][0]["expert_load_max"] > 0
    assert ref["losses"][-1] < ref["losses"][0]  # it learns
    if case["grad_clip"]:  # the clip binds, at the same norm as one process
        assert min(ref["norms"]) > case["grad_clip"]
        for r in reporters:
            assert r["norms"] == pytest.approx(ref["norms"], rel=3e-2 if bf16 else 1e-9)
    for step in range(STEPS):
        got, want = _merged(ranks, step), ref["grads"][step]
        assert sorted(got) == sorted(want)
        if bf16 and step == 0 and not any(case["plan"].get(k, 1) > 1 for k in ("tp", "cp", "pp")):
            for n, g in want.items():  # dp x ep, first step: tight (module docstring)
                err = float((got[n] - g).double().norm() / g.double().norm().clamp_min(1e-30))
                assert err < BF16["first"], (name, step, n, err)
        if bf16:
            num = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in want)
            den = sum(float(want[n].double().pow(2).sum()) for n in want)
            assert (num / den) ** 0.5 < BF16["grad"], (name, step, (num / den) ** 0.5)
            for n, g in want.items():
                err = float((got[n] - g).double().norm() / g.double().norm().clamp_min(1e-30))
                bound = BF16["routed" if ".experts." in n or ".router." in n else "tensor"]
                assert err < bound, (name, step, n, err)
            continue
        for n, g in want.items():
            err = float((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
            assert err < 1e-9, (name, step, n, err)
    for r in ranks:  # every rank's biases: equal to the reference's (moved when the rate is set)
        for n, b in r["biases"].items():
            torch.testing.assert_close(b, ref["biases"][n], rtol=0, atol=0 if not bf16 else 1e-3)
    if case["cfg"]["router_bias_rate"]:
        assert all(b.abs().sum() > 0 for b in ref["biases"].values())
    if case["plan"].get("zero", 0) < 3:  # the estimator counts the replicated MoE layers (tp)
        from mini3d.cost.params import stage_param_count

        plan = Plan(**case["plan"])
        for r in ranks:
            assert r["params"] == stage_param_count(ModelConfig(**case["cfg"]), plan, r["stage"])
            if plan.expert_tp:  # the experts split (every stage here holds a MoE layer), not whole
                whole = plan.replace(expert_tp=False)
                assert r["params"] < stage_param_count(ModelConfig(**case["cfg"]), whole, r["stage"])
    if case["state"]:
        _check_full_state(reporters, ref, bf16)


def _check_full_state(reporters, ref, bf16: bool):
    """The checkpoint's state (mini3d.checkpoint.state) holds the full experts, keyed and shaped as
    the one-process run's (float64: its values, to the gradients' bound), and restoring it gives
    it back bit for bit."""
    weights, moments = {}, {}
    for r in reporters:
        assert r["state"]["round_trip"]
        weights.update(r["state"]["weights"])
        moments.update(r["state"]["moments"])
    want = ref["state"]
    assert sorted(weights) == sorted(want["weights"]) and sorted(moments) == sorted(want["moments"])
    for n, w in want["weights"].items():
        assert weights[n].shape == w.shape, n
        if not bf16:
            torch.testing.assert_close(weights[n], w, rtol=0, atol=1e-9)
            for k, m in want["moments"].get(n, {}).items():
                torch.testing.assert_close(moments[n][k], m, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("flags,named", [
    (["--pp", "2", "--aux-loss-coef", "0.01"], ["aux_loss_scope='model'", "pp=2",
                                                "--aux-loss-scope layer"]),
    (["--cp", "2", "--capacity-factor", "1.25"], ["capacity_factor=1.25", "cp=2"]),
    (["--tp", "2", "--sequence-parallel", "--capacity-factor", "1.5"],
     ["capacity_factor=1.5", "sequence_parallel"])])
def test_what_would_not_equal_one_process_is_refused(flags, named, capsys):
    from mini3d import cli

    assert cli.main(["train", "--experts", "4", "--top-k", "2", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert all(t in err for t in named), err


def test_aux_loss_scopes_differ_and_agree_on_one_layer():
    """The two scopes are different losses (pooled vs per layer) that agree for one MoE layer."""
    from mini3d.models.transformer import GPT

    x = torch.randint(0, 256, (2, 16))
    vals = {}
    for layers in (2, 4):
        for scope in ("model", "layer"):
            cfg = dataclasses.replace(CFG, n_layers=layers, aux_loss_scope=scope, z_loss_coef=0.0)
            vals[layers, scope] = GPT(cfg, seed=1)(x, x).item()
    assert vals[2, "model"] == pytest.approx(vals[2, "layer"], abs=1e-12)  # layer 1 alone
    assert abs(vals[4, "model"] - vals[4, "layer"]) > 1e-4
