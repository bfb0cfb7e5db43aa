"""3D composition: tp x pp x dp layouts of mini3d.run.train.Trainer equal the single-process reference.

One 8-process gloo job runs every layout in turn (tests/threed_workers.run_layouts; the job
tests/conftest.py `eight_rank_job` shares with tests/test_3d_llama.py and
test_pp_zero_bubble_3d.py). The reference is
the plain `mini3d.models.transformer.GPT` with AdamW of the same hyper-parameters, trained on the full global batch
of each step (the mean token loss of the global batch = the mean over equal micro-batches of their
mean losses). Compared: the loss of every step, EVERY gradient of every step (gathered back to full
shape), and every parameter after the last step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mini3d.config import ModelConfig, Plan
from mini3d.data.corpus import Batches, load_tokens
from mini3d.models.transformer import GPT
from mini3d.run.train import make_spec
from tests.threed_workers import LR, WEIGHT_DECAY

CFG = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=256, max_seq_len=32)
STEPS, SEED = 3, 7
BASE = dict(global_batch=16, seq_len=16, bucket_mb=0.02)  # small buckets: several per stage
F64_BASE = {**BASE, "dtype": "float64"}  # exact parity: float64 layouts, F64 bounds (see below)

CASES = [  # every case uses the same 8 ranks; tp2 pp2 dp2 (ZeRO-0 with sp, ZeRO-1) are CLIP_CASES':
    # the same plans, their losses, norms before clipping and every clipped gradient checked there
    ("tp2-pp1-dp4-zero2-sp-selective", Plan(tp=2, dp=4, zero=2, micro_batches=2,
                                            sequence_parallel=True, recompute="selective", **F64_BASE)),
    ("tp1-pp2-dp4-interleaved-v2-full", Plan(pp=2, dp=4, schedule="interleaved", virtual_stages=2,
                                             micro_batches=2, recompute="full", **F64_BASE)),
    ("tp2-pp1-dp4-zero3-bf16", Plan(tp=2, dp=4, zero=3, micro_batches=2, dtype="bf16", **BASE)),
    ("tp2-pp1-dp4-zero3-sp", Plan(tp=2, dp=4, zero=3, micro_batches=2, sequence_parallel=True,
                                  **F64_BASE)),
    ("tp2-pp2-dp2-zero1-sdpa-full-sp", Plan(tp=2, pp=2, dp=2, zero=1, micro_batches=4,
                                            attention="sdpa", recompute="full",
                                            sequence_parallel=True, **F64_BASE)),
]


def reference(steps: int, grad_clip: float = 0.0, norms: list | None = None, cfg=CFG,
              global_batch: int = BASE["global_batch"], dtype=torch.float32):
    """(losses, grads per step, final params) of the unparallelised model on the global batches;
    with grad_clip, torch's clip_grad_norm_ before each update (the grads are taken after it, and
    the norms before it are appended to `norms`). dtype=torch.float64: the model in float64 (its
    float32 initial values, exactly), for the float64 parity checks (F64)."""
    model = GPT(cfg, SEED).to(dtype)
    # torch's own per-parameter groups: decay on the weight matrices, not on biases, LayerNorms or
    # the embeddings (what mini3d.optim.WeightDecay applies to ranges of the flat ZeRO masters)
    decayed = [p for n, p in model.named_parameters()
               if p.ndim >= 2 and not n.endswith(("wte.weight", "wpe.weight"))]
    rest = [p for p in model.parameters() if all(p is not q for q in decayed)]
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": WEIGHT_DECAY},
                             {"params": rest, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    batches = Batches(load_tokens(), BASE["seq_len"], global_batch, SEED)
    losses, grads = [], []
    for step in range(steps):
        x, y = batches.global_batch_at(step)
        loss = model(x, y)
        loss.backward()
        if grad_clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def merged(results: list[list[dict]], name: str, key: str, step: int | None = None) -> list[dict]:
    """Per (tp_rank, ...) copy: the union over pipeline ranks of one case's full tensors."""
    by_tp: dict[int, dict] = {}
    for per_rank in results:
        for r in per_rank:
            if r["name"] == name:
                part = r[key] if step is None else r[key][step]
                by_tp.setdefault(r["coords"]["tp"], {}).update(part)
    return list(by_tp.values())


def max_rel(got: dict, want: dict) -> tuple[float, str]:
    """max over tensors of max|got - want| / (max|want| + 1e-6), and the worst tensor's name."""
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    worst = max(want, key=lambda n: float((got[n] - want[n]).abs().max() / (want[n].abs().max() + 1e-6)))
    w = want[worst]
    return float((got[worst] - w).abs().max() / (w.abs().max() + 1e-6)), worst


def rel_norm(got: dict, want: dict, base: dict | None = None) -> float:
    """||got - want|| / ||want - base|| over all tensors together (base: zeros by default)."""
    num = sum(float((got[n] - want[n]).pow(2).sum()) for n in want)
    den = sum(float((want[n] - (base[n] if base else 0)).pow(2).sum()) for n in want)
    return (num / den) ** 0.5


# Tolerances, float32. The layouts differ from the reference only in summation order (tp
# all-reduces, dp averaging of per-replica means, micro-batch accumulation), ~1e-7 relative per op:
# - step-0 gradients agree to 1e-5 of each tensor's largest entry (measured: <1e-6);
# - parameters after 3 AdamW steps: every entry within 0.05 * lr (measured: 0.0013 lr with torch
#   2.13, 0.03 lr in embed.wte with torch 2.11, whose kernels sum in other orders). The
#   update lr * m / (sqrt(v) + eps) is nearly sign-like, so an entry whose gradient is ~eps (an
#   embedding row of a byte seen once) turns a 1e-7 relative difference into a fraction of lr: the
#   bound is in units of lr. A wrong update moves entries by ~lr, so it still fails. In aggregate the
#   parameter error is within 1e-3 of the norm of the reference's 3-step update (measured 6e-6 with
#   2.13, 6e-5 with 2.11);
# - later steps' gradients are taken at those slightly different parameters: 3e-4 of each
#   tensor's max (measured: ~3e-5);
# - losses within 1e-5 (measured: <1e-6).
F32 = dict(loss=1e-5, grad0=1e-5, grad=3e-4, param=0.05 * LR, update_norm=1e-3)
# bf16 (the ZeRO-3 case; ZeRO-0 in bf16 gives the same numbers, so this is bf16's rounding, not
# ZeRO-3) rounds activations, gradients and the dp reduction to 8 mantissa bits (~4e-3 relative),
# and then sign-like Adam updates of small-gradient entries differ by up to ~lr per step, so single
# entries are a poor measure (one fc weight's max entry is 12 % off at step 1): we bound the losses
# (1e-2 absolute; measured 4e-4), the relative norm of each step's gradient error (3 %; measured
# <1 %), and the norm of the parameter error relative to the norm of the reference's 3-step update
# (20 %; measured 5 %: bf16 follows the reference's direction of training, not every entry).
BF16 = dict(loss=1e-2, grad_norm=0.03, update_norm=0.2)
# float64 (Plan dtype "float64", and the reference in float64): the same summation-order
# differences, at ~1e-16 relative an op instead of ~1e-7, so the bounds are tight and hold on any
# machine (float32's sit within a factor 10 of what one CPU's summation order gives: an AMD EPYC
# once measured 3.06e-4 against F32's 3e-4). An entry whose gradient is ~eps no longer turns the
# rounding into a fraction of lr: its absolute error (~1e-16 of the tensor's max) is far below eps.
# Measured: losses and gradient norms within 1e-15 after 3 steps (tests/matrix, every layout).
F64 = dict(loss=1e-10, grad0=1e-10, grad=1e-10, param=1e-10 * LR, update_norm=1e-10)


def check_float32(name, plan, results, ref, cfg=CFG, bounds=F32):
    ref_losses, ref_grads, ref_params = ref
    start = {n: p.detach() for n, p in GPT(cfg, SEED).named_parameters()}
    for step in range(STEPS):
        copies = merged(results, name, "grads", step)
        assert len(copies) == plan.tp  # one full copy per tp rank (replicated tensors included)
        for g in copies:
            err, worst = max_rel(g, ref_grads[step])
            assert err < bounds["grad0" if step == 0 else "grad"], \
                f"{name} step {step}: grad of {worst} off by {err:.2e} of its max"
    for params in merged(results, name, "weights"):
        assert sorted(params) == sorted(ref_params)
        worst = max(ref_params, key=lambda n: float((params[n] - ref_params[n]).abs().max()))
        diff = float((params[worst] - ref_params[worst]).abs().max())
        assert diff < bounds["param"], f"{name}: {worst} off by {diff:.2e} after {STEPS} steps"
        err = rel_norm(params, ref_params, start)
        assert err < bounds["update_norm"], f"{name}: parameter error {err:.2e} of the update's norm"


def check_bf16(name, plan, results, ref):
    _, ref_grads, ref_params = ref
    start = {n: p.detach() for n, p in GPT(CFG, SEED).named_parameters()}
    for step in range(STEPS):
        for g in merged(results, name, "grads", step):
            err = rel_norm(g, ref_grads[step])
            assert err < BF16["grad_norm"], f"{name} step {step}: gradient error {err:.3f} of its norm"
    for params in merged(results, name, "weights"):
        err = rel_norm(params, ref_params, start)
        assert err < BF16["update_norm"], f"{name}: parameter error {err:.3f} of the update's norm"


@pytest.fixture(scope="module")
def eight_rank_runs(eight_rank_job):
    """Every rank's results of CASES and CLIP_CASES (below, EIGHT_RANK_LAYOUTS): one 8-rank launch
    runs both lists in turn, with the other selected 3d files' layouts (tests/conftest.py
    eight_rank_job), instead of one launch each (8 processes starting and importing torch is
    the costliest part of a launch on 2 cores)."""
    return eight_rank_job[__name__]


# the timeout of a test using the shared 8-rank launch (tests/conftest.py eight_rank_job) covers all
# of it, since whichever such test runs first pays for it: the sum of the modules' EIGHT_RANK_TIMEOUT
# shares (560 here, 220 test_3d_llama, 280 test_pp_zero_bubble_3d, 200 test_checkpoint, 200
# test_strict_device) and a margin
SHARED_LAUNCH_TIMEOUT = 1560
# as SHARED_LAUNCH_TIMEOUT, for the shared 4-rank launch (four_rank_job): 380 here, 400 test_cp_train, 500
# test_pairs, and a margin
SHARED_4_RANK_TIMEOUT = 1480


@pytest.mark.timeout(SHARED_LAUNCH_TIMEOUT)
def test_3d_layouts_equal_the_reference(eight_rank_runs):
    results = eight_rank_runs
    refs = {"float64": reference(STEPS, dtype=torch.float64), "bf16": reference(STEPS)}
    for name, plan in CASES:
        ref = refs[plan.dtype]
        losses = {tuple(r["losses"]) for per_rank in results for r in per_rank if r["name"] == name}
        assert len(losses) == 1, (name, losses)  # every reporting rank saw the same losses
        got = list(losses.pop())
        tol = F64["loss"] if plan.dtype == "float64" else BF16["loss"]
        assert got == pytest.approx(ref[0], abs=tol), (name, got, ref[0])
        if plan.dtype == "float64":
            check_float32(name, plan, results, ref, bounds=F64)
        else:
            check_bf16(name, plan, results, ref)
        assert all(r["opt_step"] == STEPS for per_rank in results for r in per_rank if r["name"] == name)


ACCUMULATING_CASES = [  # ZeRO-2/3 reduce-scatter every micro-batch into the shard (dp/zero.py)
    ("tp2-dp2-zero2-m4", Plan(tp=2, dp=2, zero=2, micro_batches=4, **BASE)),
    ("tp2-dp2-zero3-m4", Plan(tp=2, dp=2, zero=3, micro_batches=4, **BASE)),
    ("pp2-dp2-zero2-1f1b-m4", Plan(pp=2, dp=2, zero=2, micro_batches=4, **BASE)),
    # two chunks per rank: a bucket may span both, and their backwards interleave over micro-batches
    ("pp2-dp2-zero2-interleaved-m4", Plan(pp=2, dp=2, zero=2, schedule="interleaved",
                                          virtual_stages=2, micro_batches=4, **BASE)),
    ("pp2-dp2-zero2-zbv-m4", Plan(pp=2, dp=2, zero=2, schedule="zbv", virtual_stages=2,
                                  micro_batches=4, **BASE)),  # weight gradients in W actions
]


@pytest.mark.timeout(SHARED_4_RANK_TIMEOUT)
def test_zero2_and_zero3_accumulating_micro_batches_equal_the_reference(four_rank_runs):
    """4 micro-batches a step, over 3 steps, on 4 ranks: gradients, losses and parameters match the
    one-process reference within the float32 bounds above (ZeRO-3 is refused with pp > 1)."""
    results = four_rank_runs["accumulating"]
    ref = reference(STEPS)
    for name, plan in ACCUMULATING_CASES:
        for r in (r for per_rank in results for r in per_rank if r["name"] == name):
            assert r["losses"] == pytest.approx(ref[0], abs=F32["loss"]), (name, r["losses"])
        check_float32(name, plan, results, ref)


def test_reference_moves_so_parity_is_not_vacuous():
    """The comparison above would be blind if the parameters barely moved or the loss were flat."""
    losses, grads, params = reference(STEPS)
    start = dict(GPT(CFG, SEED).named_parameters())
    moved = min(float((params[n] - start[n]).detach().abs().max()) for n in params if "wte" not in n)
    assert moved > 0.5 * LR  # every tensor (but rarely-seen embedding rows) moved by ~lr per step
    assert losses[0] != losses[-1] and all(g["head.out.weight"].abs().max() > 0 for g in grads)


def test_zero3_with_pipeline_is_refused_with_its_cost_and_an_alternative():
    problems = Plan(pp=2, dp=2, zero=3, micro_batches=4, **BASE).problems(CFG, 4)
    msg = " ".join(problems)
    assert len(problems) == 1, problems
    assert "zero=3 with pp=2" in msg and "micro_batches=4" in msg  # names the offending values
    assert "gathers" in msg and "--zero 1" in msg  # explains the cost, suggests ZeRO-1
    assert not Plan(pp=2, dp=2, zero=1, micro_batches=4, **BASE).problems(CFG, 4)
    assert not Plan(dp=4, zero=3, **BASE).problems(CFG, 4)


OVERLAP_PLANS = {  # the event-order tests below (run after ACCUMULATING_CASES, in the same launch)
    "interleaved": Plan(pp=2, dp=2, schedule="interleaved", virtual_stages=2, micro_batches=2,
                        global_batch=8, seq_len=16, bucket_mb=0.02),
    **{f"sp-zero{z}": Plan(tp=2, dp=2, zero=z, micro_batches=2, global_batch=8, seq_len=16,
                           sequence_parallel=True, bucket_mb=0.02) for z in (0, 2)},
}


def four_rank_parts(tmp_dir: str) -> list[tuple]:
    """This module's part of the shared 4-rank launch (tests/conftest.py four_rank_job): the
    ACCUMULATING_CASES layouts, then the OVERLAP_PLANS runs."""
    cases = [{"name": n, "plan": dataclasses.asdict(p)} for n, p in ACCUMULATING_CASES]
    specs = [make_spec(CFG, p, steps=2, collect=["events"]) for p in OVERLAP_PLANS.values()]
    return [("layouts", cases, dataclasses.asdict(CFG)), ("specs", specs)]


FOUR_RANK_TIMEOUT = 380


@pytest.fixture(scope="module")
def four_rank_runs(four_rank_job):
    """Every 4-rank run of this file from one launch (shared with tests/test_cp_train.py and
    test_pairs.py: tests/conftest.py four_rank_job; a 4-rank launch's start-up cost about 20 CPU
    seconds of the 69 its three overlap tests took alone): {"accumulating": every rank's
    run_layouts results of ACCUMULATING_CASES, name in OVERLAP_PLANS: every rank's result}."""
    _, (layouts, runs) = four_rank_job[__name__]
    out = {"accumulating": layouts}
    out.update({name: [mine[k] for mine in runs] for k, name in enumerate(OVERLAP_PLANS)})
    return out


@pytest.mark.timeout(SHARED_4_RANK_TIMEOUT)
def test_interleaved_pipeline_overlaps_the_dp_gradient_sync(four_rank_runs):
    """pp2 x dp2, interleaved (v=2): each model chunk's buckets are all-reduced during that chunk's
    last backward, while the pipeline still runs the earlier chunk's backwards, not after it all.
    On pipeline rank 0 (chunks 0 and 2) the first dp all-reduce of the step is issued inside
    action B2.1 (chunk 2's last backward), before the receives that feed chunk 0's backwards."""
    for r in four_rank_runs["interleaved"]:
        step = [e for e in r["events"] if e["context"].get("step") == 1]
        dp = [e for e in step if e["axis"] == "dp" and e["op"] == "all_reduce" and e["bytes"] > 64]
        pp = [e for e in step if e["axis"] == "pp" and e["op"] in ("send", "recv")]
        assert dp and pp, r["coords"]
        first = min(dp, key=lambda e: e["start"])
        last_stage = 2 if r["coords"]["pp"] == 0 else 3  # the chunk whose backward ends first
        assert first["context"]["action"] == f"B{last_stage}.1", first["context"]
        assert first["start"] < max(e["start"] for e in pp), r["coords"]


@pytest.mark.timeout(SHARED_4_RANK_TIMEOUT)
@pytest.mark.parametrize("zero", [0, 2])
def test_sequence_parallel_overlaps_the_dp_gradient_sync(zero, four_rank_runs):
    """tp2 x dp2 with sequence parallelism: the dp gradient collectives start during the last
    backward (before its last sequence all-gather / reduce-scatter), and the replicated
    parameters' partial gradients are summed over tp after them, one all-reduce per step."""
    out = four_rank_runs[f"sp-zero{zero}"]
    dp_op = "all_reduce" if zero == 0 else "reduce_scatter"
    for r in out:
        step = [e for e in r["events"] if e["context"].get("step") == 1]
        dp = [e for e in step if e["axis"] == "dp" and e["op"] == dp_op and e["bytes"] > 64]  # not the loss
        seq = [e for e in step if e["axis"] == "tp" and e["op"] in ("all_gather", "reduce_scatter")]
        tp_sums = [e for e in step if e["axis"] == "tp" and e["op"] == "all_reduce"
                   and e["start"] > max(x["end"] for x in dp)]
        assert min(e["start"] for e in dp) < max(e["start"] for e in seq), r["coords"]
        assert len(tp_sums) == 1, [(e["op"], e["bytes"]) for e in tp_sums]


CLIP_CASES = [  # dp replicas with sequence parallelism; dp shards (ZeRO-1, ZeRO-3) across pp or tp
    ("tp2-pp2-dp2-zero0-sp-clip", Plan(tp=2, pp=2, dp=2, zero=0, micro_batches=4,
                                       sequence_parallel=True, **F64_BASE)),
    ("tp2-pp2-dp2-zero1-clip", Plan(tp=2, pp=2, dp=2, zero=1, micro_batches=4, **F64_BASE)),
    ("tp2-pp1-dp4-zero3-clip", Plan(tp=2, dp=4, zero=3, micro_batches=2, **F64_BASE)),
]
CLIP = 0.5  # the reference's norms are 1.4-3.1: every step clips
# this module's part of the shared 8-rank launch (tests/conftest.py eight_rank_job)
EIGHT_RANK_LAYOUTS = ([{"name": n, "plan": dataclasses.asdict(p)} for n, p in CASES]
                      + [{"name": n, "plan": dataclasses.asdict(p), "grad_clip": CLIP}
                         for n, p in CLIP_CASES], dataclasses.asdict(CFG))
EIGHT_RANK_TIMEOUT = 560


@pytest.mark.timeout(SHARED_LAUNCH_TIMEOUT)
def test_gradient_clipping_equals_torch_clip_grad_norm_on_the_reference(eight_rank_runs):
    """--grad-clip: the global norm over every shard (tp pieces summed, replicated ones once, dp
    shards summed, replicas not, pp stages summed) equals torch.nn.utils.clip_grad_norm_'s on the
    unsharded model, and the clipped gradients, losses and parameters match it (float64, F64)."""
    results = eight_rank_runs
    ref_norms = []
    ref = reference(STEPS, CLIP, ref_norms, dtype=torch.float64)
    assert min(ref_norms) > 2 * CLIP  # the clipping is active at every step
    for name, plan in CLIP_CASES:
        runs = [r for per_rank in results for r in per_rank if r["name"] == name]
        for r in runs:
            assert r["losses"] == pytest.approx(ref[0], abs=F64["loss"]), (name, r["losses"])
            assert r["norms"] == pytest.approx(ref_norms, rel=1e-10), (name, r["norms"], ref_norms)
        check_float32(name, plan, results, ref, bounds=F64)
