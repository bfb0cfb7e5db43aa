"""`--expert-tp` outside the parity launches (those are tests/test_moe_splits.py's `expert-tp`
cases): what the estimator and the time model count for it, and the input it refuses."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mini3d import cli
from mini3d.comm import ring_wire_bytes
from mini3d.config import ModelConfig, Plan
from mini3d.cost.activations import ELEMENT_BYTES, moe_tokens
from mini3d.cost.comm_time import tp_time
from mini3d.cost.hardware import PRESETS
from mini3d.cost.memory import estimate_memory
from mini3d.cost.moe import a2a_buffer_bytes

CFG = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=256, max_seq_len=64, d_ff=128,
                  family="llama", n_experts=8, top_k=2, moe_ffn=64, n_shared_experts=1,
                  dense_layers=1, name="etp")
PLAN = Plan(tp=2, seq_len=64, global_batch=8)


def test_the_estimators_expert_states_halve_with_expert_tp_at_tp2():
    whole = estimate_memory(CFG, PLAN, 0)
    split = estimate_memory(CFG, PLAN.replace(expert_tp=True), 0)
    w, s = whole.detail["experts"], split.detail["experts"]
    assert w["n_params"] == 3 * 8 * 3 * 64 * 64  # 3 MoE layers x 8 experts x (gate, up, down)
    assert s["n_params"] * 2 == w["n_params"]
    for k in ("params", "grads", "optimizer"):
        assert s[k] * 2 == w[k], k
    # the shared expert splits like the MLP: everything else is the dense count less its half
    shared = CFG.moe_params(2)["shared"]
    assert CFG.moe_params(2, expert_tp=True)["shared"] * 2 == shared
    dense_drop = 3 * shared // 2
    assert (whole.n_params - w["n_params"]) - (split.n_params - s["n_params"]) == dense_drop
    assert CFG.moe_params(2, expert_tp=True)["router"] == CFG.moe_params(2)["router"]  # replicated


def test_estimate_expert_tp_on_the_command_line(capsys):
    argv = ["estimate", "--experts", "8", "--top-k", "2", "--moe-ffn", "64", "--tp", "2",
            "--hidden", "64", "--heads", "4", "--json"]
    got = {}
    for extra in ([], ["--expert-tp"]):
        assert cli.main(argv + extra) == 0
        got[bool(extra)] = json.loads(capsys.readouterr().out)
    assert got[True]["plan"]["expert_tp"] and not got[False]["plan"]["expert_tp"]
    split, whole = (got[k]["memory_per_rank_bytes"] for k in (True, False))
    assert split["experts"]["params"] * 2 == whole["experts"]["params"]  # the JSON shows it
    assert split["experts"]["total"] * 2 == whole["experts"]["total"]
    assert split["total"] < whole["total"]
    assert got[True]["comm_bytes_per_rank"]["tp"] > got[False]["comm_bytes_per_rank"]["tp"]


@pytest.mark.parametrize("sp", [False, True])
def test_the_time_model_adds_the_expert_tp_reduction(sp):
    """Per MoE layer and micro-batch: forward and backward, one all-reduce of the rank's routed
    rows each (sp: an all-gather and a reduce-scatter of the tp group's rows each)."""
    hw, plan = PRESETS["A100-80GB"], PLAN.replace(sequence_parallel=sp)
    _, _, whole = tp_time(CFG, plan, hw, 4, hw.nvlink_bw)
    fwd, bwd, split = tp_time(CFG, plan.replace(expert_tp=True), hw, 4, hw.nvlink_bw)
    rows = a2a_buffer_bytes(moe_tokens(plan), CFG.d_model, CFG.top_k, ELEMENT_BYTES["float32"])
    per_way = (ring_wire_bytes("all_gather", 2, 2 * rows) + ring_wire_bytes("reduce_scatter", 2, 2 * rows)
               if sp else ring_wire_bytes("all_reduce", 2, rows))
    assert split - whole == pytest.approx(3 * 2 * per_way)  # 3 MoE layers, forward + backward
    assert fwd > 0 and bwd > 0


@pytest.mark.parametrize("flags,named", [
    (["--expert-tp"], ["expert_tp", "tp=1", "--tp N"]),
    (["--expert-tp", "--tp", "2", "--experts", "0"], ["expert_tp", "n_experts=0", "--experts E"]),
    (["--expert-tp", "--tp", "2", "--moe-ffn", "33"], ["moe_width=33", "tp=2",
                                                       "choose tp in [1, 3, 11, 33]"]),
    (["--expert-tp", "--tp", "2", "--sample-every", "1"], ["expert_tp with --sample-every"])])
def test_what_expert_tp_cannot_split_is_refused_before_anything_starts(flags, named, capsys):
    assert cli.main(["train", "--experts", "4", "--top-k", "2", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert all(t in err for t in named), err


def test_a_model_without_expert_tp_is_unchanged():
    """The default keeps the experts whole on every tp rank (Megatron-Core's expert-tp 1)."""
    assert Plan().expert_tp is False
    assert CFG.moe_params(2) == CFG.moe_params(1)
    assert dataclasses.replace(PLAN, expert_tp=True).problems(CFG) == []
