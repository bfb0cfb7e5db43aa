"""Data parallelism and ZeRO 0-3: parity with the single-process reference, the memory ledger
against the ZeRO paper's formulas, communicated bytes from the event log, and overlap.

Two launches carry the multi-process checks: dp=4 runs the four stages in float32, dp=2 runs the
four stages in float32 and then in bf16. Each run trains len(MICRO)=4 AdamW steps (three with 2
micro-batches accumulated under no_sync, one with a single micro-batch) on a GPT whose block size
(4122 parameters) is not a multiple of 4, so dp=4 shards are padded.
"""

import pytest
import torch

from mini3d.config import Plan
from mini3d.launch import launch
from tests import dp_workers as W

STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def ref():
    return W.reference()


def expected_wire(stage, n, layout, elem, m):
    """Ring wire bytes one rank sends in a step, op by op as comm.py counts them (floored)."""
    rs_or_ag = sum((n - 1) * (padded * elem) // n for _, padded in layout)
    if stage == 0:
        return sum(2 * (n - 1) * (padded * elem) // n for _, padded in layout)
    if stage in (1, 2):
        return 2 * rs_or_ag  # reduce-scatter the grads + all-gather the params
    return (2 * m + 1) * rs_or_ag  # gather in forward and in backward per micro-batch + one RS


def expected_ledger(stage, n, layout, dtype):
    """Per-category bytes the ZeRO paper predicts, with this layout's padding."""
    psi_pad = sum(p for _, p in layout)
    shard = psi_pad // n if stage else psi_pad  # what this rank's optimizer steps
    pb = 2 if dtype == "bf16" else 4
    return {"parameters": pb * (shard if stage == 3 else psi_pad),
            "gradients": pb * (shard if stage >= 2 else psi_pad),
            "master_weights": 4 * shard if dtype == "bf16" else 0,  # fp32 master = the param shard
            "optimizer_states": 8 * shard}  # Adam: exp_avg + exp_avg_sq, fp32


PAPER = {  # bytes per parameter, Psi = parameters, Nd = dp (Rajbhandari et al. 2020, Figure 1)
    "bf16": {0: lambda n: 16, 1: lambda n: 4 + 12 / n, 2: lambda n: 2 + 14 / n, 3: lambda n: 16 / n},
    "float32": {0: lambda n: 16, 1: lambda n: 8 + 8 / n, 2: lambda n: 4 + 12 / n,
                3: lambda n: 16 / n},
}


def check_run(res, dp, stage, dtype, ref):
    r0 = res[0][(stage, dtype)]
    losses = [sum(r[(stage, dtype)]["loss"][i] for r in res) / dp for i in range(len(W.MICRO))]
    ref_loss, ref_grads, ref_params = ref
    psi = r0["n_params"]
    layout = r0["layout"]
    n_groups = len(layout)
    assert sum(numel for numel, _ in layout) == psi
    pad = sum(p for _, p in layout) - psi
    assert 0 <= pad <= n_groups * (dp - 1)  # padding only to make shards equal (buckets.py)
    if dtype == "float32":
        # float32: only the summation order differs (per-replica means, then the dp average),
        # a few ulp of a loss near 4 -> 1e-5 absolute.
        assert losses == pytest.approx(ref_loss, abs=1e-5)
        for k, g in ref_grads.items():  # gradients ~1e-2; reduction-order noise ~1e-8
            torch.testing.assert_close(r0["grads"][k], g, rtol=1e-4, atol=1e-6, msg=k)
        # AdamW moves each weight by ~lr=1e-2 per step whatever the gradient's size, so a 1e-7
        # relative gradient difference on a near-zero gradient can shift an update slightly;
        # 1e-4 is 1% of one step and 100x below what a wrong gradient or missed step gives.
        for k, p in ref_params.items():
            torch.testing.assert_close(r0["params"][k], p, rtol=0, atol=1e-4, msg=k)
    else:
        # bf16 compute (8-bit mantissa): the loss stays within 1e-2 of the fp32 reference, and
        # parameters within 4 steps x lr of it (Adam's near sign-like updates on rounded grads).
        assert losses == pytest.approx(ref_loss, abs=1e-2)
        for k, p in ref_params.items():
            torch.testing.assert_close(r0["params"][k], p, rtol=0, atol=4e-2, msg=k)
    elem = 2 if dtype == "bf16" else 4
    for rank, r in enumerate(res):
        rr = r[(stage, dtype)]
        for step, m in enumerate(W.MICRO):
            assert rr["wire"][step] == expected_wire(stage, dp, layout, elem, m), (rank, step)
        led = rr["ledger"][-1]
        exp = expected_ledger(stage, dp, layout, dtype)
        assert {k: led[k] for k in exp} == exp, (rank, led, exp)
        assert led["optimizer_scalars"] == 4 * n_groups  # AdamW's fp32 `step` per flat group
        per_param = PAPER[dtype][stage](dp)
        assert abs(led["total"] - led["optimizer_scalars"] - per_param * psi) <= 16 * pad
        # overlap: the first bucket's collective was issued before backward's last gradient
        assert rr["first_sync_start"] is not None and rr["first_sync_start"] < rr["backward_end"]
    # ring volumes, unrounded: 2 (n-1)/n Psi for stages 0-2, 3 (n-1)/n Psi for stage 3 (M=1)
    ring = (3 if stage == 3 else 2) * (dp - 1) / dp * psi * elem
    assert abs(r0["wire"][-1] - ring) <= (3 * pad + 3 * n_groups) * elem


@pytest.mark.timeout(240)
def test_dp4_zero_stages_match_reference(ref):
    res = launch(W.dp_parity, 4, 4, [(s, "float32") for s in STAGES], timeout=200)
    for s in STAGES:
        check_run(res, 4, s, "float32", ref)
    layout3 = res[0][(3, "float32")]["layout"]
    assert any(p > n for n, p in layout3)  # the test really exercises padding


@pytest.mark.timeout(240)
def test_dp2_zero_stages_float32_and_bf16(ref):
    runs = [(s, "float32") for s in STAGES] + [(s, "bf16") for s in STAGES]
    res = launch(W.dp_parity, 2, 2, runs, timeout=200)
    for s, d in runs:
        check_run(res, 2, s, d, ref)
    # every bf16 stage computes the same thing: identical losses across stages
    bf = [res[0][(s, "bf16")]["loss"] for s in STAGES]
    assert all(b == pytest.approx(bf[0], abs=1e-6) for b in bf)


def test_plan_refuses_bad_zero_and_batch(tiny):
    probs = Plan(dp=2, zero=4).problems(tiny)
    assert any("zero=4" in p and "0, 1, 2 or 3" in p for p in probs)
    probs = Plan(dp=3, micro_batches=1, global_batch=8).problems(tiny)
    assert any("global_batch=8" in p and "dp=3" in p for p in probs)
    probs = Plan(dp=2, micro_batches=3, global_batch=8).problems(tiny)
    assert any("micro_batches=3" in p for p in probs)
    assert Plan(dp=2, zero=3, micro_batches=2, global_batch=8).problems(tiny) == []
    from mini3d.dp import make_dp
    with pytest.raises(ValueError, match="zero=5"):
        make_dp(torch.nn.Linear(2, 2), None, Plan(zero=5), torch.optim.AdamW)
