"""MoE models train with data parallelism: dp=2 equals the one-process run (losses, every step's
averaged gradients, final weights, the aux-loss-free biases and the reported expert load), and the
splits that would be silently wrong with experts are refused with exit 2 before any process.

Tolerance: float32, the same micro-batches summed in another order (dp's average vs one rank's
accumulation): 1e-5 relative on losses and weights, 1e-4 relative / 1e-7 absolute on gradients.
"""

from __future__ import annotations

import pytest
import torch

from mini3d.config import ModelConfig, Plan
from mini3d.launch.launcher import launch
from tests.moe_workers import train_moe

CFG = ModelConfig(n_layers=3, d_model=16, n_heads=2, vocab_size=64, max_seq_len=16, d_ff=32,
                  family="llama", n_experts=4, top_k=2, n_shared_experts=1, dense_layers=1,
                  aux_loss_coef=0.01, z_loss_coef=1e-3, capacity_factor=1.25, name="moe-test")
SIGMOID = ModelConfig(**{**CFG.__dict__, "router": "sigmoid", "router_bias_rate": 0.05,
                         "capacity_factor": 0.0, "name": "moe-sigmoid"})
STEPS = 3


def dp2_matches_one_process(cfg) -> dict:
    """dp=2 against one rank running the two dp slices as micro-batches (float32): losses (1e-5),
    every step's gradients (1e-4), final weights, the aux-loss-free biases and the expert load.
    Returns the one-process run."""
    one = launch(train_moe, 1, cfg, Plan(global_batch=8, seq_len=16, micro_batches=2), STEPS,
                 device="cpu", timeout=120)[0]
    two = launch(train_moe, 2, cfg, Plan(dp=2, global_batch=8, seq_len=16, micro_batches=1), STEPS,
                 device="cpu", timeout=120)
    assert one["losses"][-1] < one["losses"][0]  # it learns
    for r in two:
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5)
        for a, b in zip(r["grads"], one["grads"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
        for n, p in one["params"].items():
            torch.testing.assert_close(r["params"][n], p, rtol=1e-5, atol=1e-6)
        for n, b in one["biases"].items():
            torch.testing.assert_close(r["biases"][n], b)
        assert r["loads"] == one["loads"]  # all-reduced over dp: the global batch's load
    return one


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cfg", [CFG, SIGMOID], ids=["softmax-capacity", "sigmoid-bias"])
def test_dp2_equals_one_process(cfg):
    one = dp2_matches_one_process(cfg)
    load = one["loads"][0]
    assert load["expert_load_min"] <= load["expert_load_max"] and load["expert_load_cv"] >= 0
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    for rec in one["loads"]:  # every token-slot of the global batch, processed or dropped
        assert sum(rec["expert_load"]) + rec["dropped_tokens"] == 8 * 16 * cfg.top_k * moe_layers
        assert min(rec["expert_load"]) == rec["expert_load_min"]
        assert max(rec["expert_load"]) == rec["expert_load_max"]
    moved = [b.abs().sum() for b in one["biases"].values()]
    assert (min(moved) > 0) == bool(cfg.router_bias_rate)
    if cfg.capacity_factor:
        assert sum(rec["dropped_tokens"] for rec in one["loads"]) > 0


@pytest.mark.timeout(300)
def test_expert_bias_is_saved_and_resumed(tmp_path):
    """The aux-loss-free biases live outside the optimizer: a checkpoint holds them, and a run
    resumed from it continues bitwise (losses and final biases), as does `sample`'s model."""
    import os

    from mini3d.checkpoint.store import read_states
    from mini3d.run.sample import load_model
    from mini3d.run.train import make_spec, reporter_records
    from tests.threed_workers import run_specs

    plan = Plan(global_batch=4, seq_len=16)
    # the byte tokenizer's vocabulary; a rate small against the scores' spread (0.05 flips every
    # choice each step, and two steps bring the biases back to zero)
    cfg = ModelConfig(**{**SIGMOID.__dict__, "vocab_size": 256, "router_bias_rate": 1e-3})
    spec = lambda **kw: make_spec(cfg, plan, steps=4, seed=2, lr=1e-2, **kw)
    full = str(tmp_path / "full")
    first = launch(run_specs, 1, [spec(save=full, save_every=2),
                                  spec(resume=os.path.join(full, "step-000002"),
                                       save=str(tmp_path / "again"))],
                   device="cpu", timeout=200)[0]
    whole, resumed = (reporter_records([r]) for r in first)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[2:]]
    step2 = read_states(os.path.join(full, "step-000002"))["model"]
    bias = {n: t for n, t in step2.items() if n.endswith("expert_bias")}
    assert sorted(bias) == ["blocks.1.mlp.expert_bias", "blocks.2.mlp.expert_bias"]
    assert all(t.abs().sum() > 0 for t in bias.values())  # moved by two steps of updates
    ends = [read_states(os.path.join(d, "step-000004"))["model"]
            for d in (full, str(tmp_path / "again"))]
    for n in bias:  # four updates in both: the resumed run started from the saved biases
        assert torch.equal(ends[0][n], ends[1][n]) and not torch.equal(ends[0][n], bias[n])
    model, _ = load_model(os.path.join(full, "step-000002"))
    torch.testing.assert_close(model.blocks["1"].mlp.expert_bias, bias["blocks.1.mlp.expert_bias"])
