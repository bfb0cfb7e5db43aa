"""Context parallelism's costs: the estimator's activations and the cost model's ring bytes against
a real run (the activation ledger and the event log), the estimate CLI at 131072 tokens, and the
planner choosing cp for long sequences."""

from __future__ import annotations

import json

import pytest

from mini3d.config import ModelConfig, Plan
from mini3d.cost.hardware import PRESETS as GPUS
from mini3d.cost.model import estimate_cost
from mini3d.cost.planner import search
from mini3d.cost.activations import layer_activation_bytes
from mini3d.cost.memory import estimate_memory
from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec
from tests.cp_workers import measured_ring

CFG = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=256, max_seq_len=64)
# a Llama-3.1-8B-sized GPT (the llama presets are another branch's): 32 x 4096, 32 heads
LONG = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000",
        "--seq-len", "131072", "--max-seq-len", "131072", "--dtype", "bf16", "--global-batch", "1",
        "--gpu", "H100-80GB", "--attention", "sdpa"]


@pytest.mark.timeout(120)
def test_ring_activations_and_bytes_match_a_real_run():
    """tp2 x cp2, 2 micro-batches, 4 layers, float32. Activations: the ledger's bytes of layer 0 per
    micro-batch within 2% of the estimate (it leaves out the LayerNorm statistics, as in
    tests/test_recompute.py). Bytes: step 1's cp sends equal the cost model's per-step count
    exactly (per layer and micro-batch: 1 K/V block forward, 1 backward, 2 dK/dV accumulators)."""
    plan = Plan(tp=2, cp=2, global_batch=4, micro_batches=2, seq_len=64)
    spec = make_spec(CFG, plan, steps=2, collect=["activations", "events"])
    results = launch(measured_ring, 4, spec, device="cpu", timeout=100)
    want_layer = layer_activation_bytes(CFG, plan)["stored"]
    cost = estimate_cost(CFG, plan, GPUS["A100-80GB"])
    for r in results:
        assert abs(r["layer0"] - want_layer) / want_layer < 0.02, (r["layer0"], want_layer)
        assert r["send_bytes"] == cost.comm_bytes["cp"], (r["send_bytes"], cost.comm_bytes)
        assert r["sends"] == 4 * CFG.n_layers * plan.micro_batches
    # without cp the same tokens keep the (s, s) probabilities: the ring saves more than half
    assert want_layer < 0.5 * layer_activation_bytes(CFG, plan.replace(cp=1))["stored"]


def _estimate(*extra) -> dict:
    import contextlib
    import io

    from mini3d.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["estimate", *LONG, "--tp", "8", *extra, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_estimate_activations_per_rank_fall_with_cp_and_the_explanation_names_cp():
    acts = {cp: _estimate("--cp", str(cp))["memory_per_rank_bytes"]["activations"]
            for cp in (1, 2, 4, 8)}
    assert acts[1] > acts[2] > acts[4] > acts[8], acts
    for cp in (4, 8):  # per-token activations divide by cp exactly
        assert acts[cp] / acts[cp // 2] == pytest.approx(0.5, rel=1e-6), acts
    alone = _estimate()
    assert not alone["fits"]
    assert "context parallelism (--cp N)" in alone["explanation"]
    assert "with cp=4 (32 GPUs)" in alone["explanation"], alone["explanation"]
    assert _estimate("--cp", "8")["fits"]
    # the ring's bytes and exposure are in the answer
    eight = _estimate("--cp", "8")
    assert eight["comm_bytes_per_rank"]["cp"] > 0
    assert 0 < eight["breakdown_s"]["cp_comm"] < eight["breakdown_s"]["cp_total"]


def test_planner_splits_long_sequences_over_cp_only():
    cfg = ModelConfig(32, 4096, 32, 32000, 131072, name="8b-long")
    long = search(cfg, 32, GPUS["H100-80GB"], 4, 131072, attention="sdpa", suggest=False)
    assert long.fits and all(c.plan.cp > 1 for c in long.candidates)
    assert all(estimate_memory(cfg, c.plan).fits(GPUS["H100-80GB"].memory_bytes)
               for c in long.candidates)
    short = search(cfg, 8, GPUS["H100-80GB"], 8, 2048, attention="sdpa", suggest=False)
    assert short.fits and all(c.plan.cp == 1 for c in short.candidates)
