"""The cost model, estimator, planner and dry run with mixture of experts and expert parallelism
(issue #30 item 5): expert states per ep rank, the MoE layer's activations against the
saved-tensor ledger, active FLOPs, the all-to-alls (volume from mini3d.cost.moe, the one owner),
the planner's ep, the dry run's ep lines, and the MoE presets against their model cards."""

import argparse
import dataclasses
import json

import pytest
import torch

from mini3d.config import PRESETS, ModelConfig, Plan
from mini3d.cost.activations import layer_activation_bytes, moe_activation_bytes, moe_tokens
from mini3d.cost.comm_time import ep_time, ep_wire_bytes, members_per_node
from mini3d.cost.hardware import PRESETS as GPUS
from mini3d.cost.memory import estimate_memory
from mini3d.cost.params import stage_expert_count, stage_param_count
from mini3d.cost.model import estimate_cost
from mini3d.cost.flops import flops_per_token, model_flops
from mini3d.cost.moe import A2A_PER_LAYER, a2a_buffer_bytes, a2a_bytes
from mini3d.run.cost_cli import register

MIXTRAL = PRESETS["mixtral-8x7b"]
H100 = GPUS["H100-80GB"]
TINY_MOE = ModelConfig(2, 64, 4, 256, 128, family="llama", n_experts=4, top_k=2, moe_ffn=96,
                       dense_layers=1)  # layer 0 dense, layer 1 MoE


def cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="mini3d")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc = args.func(args)
    return rc, capsys.readouterr().out


# ----------------------------------------------------------------------------- model states

@pytest.mark.timeout(30)
def test_expert_parameters_are_counted_as_the_module_holds_them():
    """At tp=1 ep=1 the estimator's expert share is exactly the module's `experts.` tensors and the
    rest is every other parameter; tp splits no part of a MoE layer (the engine keeps it whole on
    every tp rank: mini3d.tp.parallelize), ep divides the routed experts."""
    from mini3d.models.transformer import GPT

    cfg = dataclasses.replace(TINY_MOE, n_shared_experts=1)
    with torch.device("meta"):
        model = GPT(cfg, init=False)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    plan = Plan(global_batch=2, seq_len=64)
    assert stage_expert_count(cfg, plan, 0) == experts
    assert stage_param_count(cfg, plan, 0) == sum(p.numel() for p in model.parameters())
    assert stage_expert_count(cfg, plan.replace(tp=2), 0) == experts  # whole on each tp rank
    assert cfg.moe_params(2) == cfg.moe_params(1)  # router, experts, shared: whole on each tp rank
    assert stage_expert_count(cfg, plan.replace(dp=4, ep=4), 0) == experts // 4


@pytest.mark.timeout(30)
def test_expert_states_shrink_by_ep_and_shard_over_the_expert_data_parallel_group():
    """Mixtral 8x7B, bf16 (2 + 4 + 12 bytes per parameter): ep=8 over dp=8 holds 1 of 8 experts per
    rank, so the experts' params, grads and optimizer shrink by exactly 8 while the dense states
    stay; under ZeRO-1 the experts' optimizer shards over dp*cp/ep ranks (dp=16, ep=8: 2), the
    dense optimizer over dp=16."""
    base = Plan(dp=8, dtype="bf16", seq_len=4096, global_batch=8, recompute="full")
    one, eight = (estimate_memory(MIXTRAL, base.replace(ep=e)) for e in (1, 8))
    x1, x8 = one.detail["experts"], eight.detail["experts"]
    for k in ("n_params", "params", "grads", "optimizer"):
        assert x1[k] == 8 * x8[k], k
    assert x1["n_params"] == 32 * 8 * 3 * 4096 * 14336  # 32 layers x 8 experts x 3 matrices
    dense = lambda e: e.params - e.detail["experts"]["params"]  # noqa: E731
    assert dense(one) == dense(eight)
    z1 = estimate_memory(MIXTRAL, base.replace(dp=16, ep=8, zero=1, global_batch=16))
    n_exp, n_all = z1.detail["experts"]["n_params"], z1.n_params
    assert z1.detail["experts"]["optimizer"] == n_exp * 12 // 2
    assert z1.optimizer == pytest.approx((n_all - n_exp) * 12 / 16 + n_exp * 12 / 2, abs=2)


@pytest.mark.timeout(60)
def test_estimate_json_reports_the_experts_category_shrinking_by_ep(capsys):
    """`mini3d estimate --model mixtral-8x7b --ep 8 --dp 8 --json`: the experts' share of every
    model-state category is an eighth of --ep 1's; the all-to-all bytes are reported per axis."""
    argv = ["estimate", "--model", "mixtral-8x7b", "--dp", "8", "--dtype", "bf16", "--seq-len",
            "4096", "--global-batch", "8", "--gpu", "H100-80GB", "--json"]
    outs = {}
    for ep in ("1", "8"):
        rc, text = cli(argv + ["--ep", ep], capsys)
        assert rc == 0
        outs[ep] = json.loads(text)
    e1, e8 = (outs[k]["memory_per_rank_bytes"]["experts"] for k in ("1", "8"))
    for k in ("params", "grads", "optimizer", "total"):
        assert e1[k] == 8 * e8[k], k
    assert "ep" not in outs["1"]["comm_bytes_per_rank"]
    plan = Plan(dp=8, ep=8, dtype="bf16", seq_len=4096, global_batch=8)
    one = a2a_bytes(moe_tokens(plan), 4096, 2, 8, 2)  # 4096 tokens x top-2 x 7/8 x d x 2 bytes
    assert outs["8"]["comm_bytes_per_rank"]["ep"] == A2A_PER_LAYER * 32 * one


# ----------------------------------------------------------------------------- activations

def measured_ledger(cfg):
    """The saved-tensor ledger (`mini3d.recompute.measure_activations`) of one forward of a GPT of
    `cfg` over two sequences of 64 tokens (seed 0)."""
    from mini3d.models.transformer import GPT
    from mini3d.recompute import measure_activations

    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 64))
    with measure_activations(model) as led:
        model(x, x)
    return led


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family,capacity,shared", [("llama", 0.0, 0), ("llama", 0.5, 0),
                                                    ("gpt2", 0.0, 1), ("gpt2", 0.5, 0)])
def test_moe_activations_equal_the_saved_tensor_ledger(family, capacity, shared):
    """One forward of a 2-layer model (layer 1 a MoE) under the saved-tensor ledger: the MoE
    block's mixture keeps what `moe_activation_bytes` counts plus its input (the norm output
    the block's terms already hold), within 1% (the formula leaves out the int32 counts per
    expert and the capacity rule's mask and kept indices: 48 and ~2.3 KB here). Counting each
    token once instead of top_k times, or the capacity factor not at all, misses by 25-50%.
    And the whole MoE block is the dense block's estimate with the MLP's terms swapped."""
    cfg = dataclasses.replace(TINY_MOE, family=family, capacity_factor=capacity,
                              n_shared_experts=shared)
    plan = Plan(global_batch=2, seq_len=64)
    led = measured_ledger(cfg)
    measured = led.by_category["layer1.mlp"]
    block_input = 2 * 64 * cfg.d_model * 4
    assert abs(moe_activation_bytes(cfg, plan) + block_input - measured) < 0.01 * measured
    est = layer_activation_bytes(cfg, plan, moe=True)["stored"]
    assert abs(est - led.layer_bytes(1)) < 0.04 * led.layer_bytes(1)  # the dense terms' 2%
    mem = estimate_memory(cfg, plan)
    dense = layer_activation_bytes(cfg, plan)["stored"]
    assert mem.activations == pytest.approx(dense + est + mem.detail["head_bytes"], abs=1)


def test_ep_receive_buffers_are_comm_buffers():
    plan = Plan(dp=2, ep=2, global_batch=2, seq_len=64)
    buffers = estimate_memory(TINY_MOE, plan).detail["comm_buffers"]
    assert buffers["ep"] == 2 * a2a_buffer_bytes(64, 64, 2, 4)
    assert estimate_memory(TINY_MOE, plan.replace(ep=1)).detail["comm_buffers"]["ep"] == 0


# ----------------------------------------------------------------------------- FLOPs

def test_mfu_counts_active_parameters():
    """Model FLOPs per token / 6 minus the attention core is the parameters one token multiplies
    with: Mixtral's active 12.9e9 less the embedding table (a lookup) and the norms, not 46.7e9."""
    plan = Plan(dp=8, dtype="bf16", seq_len=4096, global_batch=8)
    f = flops_per_token(MIXTRAL, 4096)
    matmul_params = model_flops(MIXTRAL, plan) / (6 * 8 * 4096) - 32 * f["attention"] / 2
    norms = 32 * 2 * 4096 + 4096
    assert matmul_params == pytest.approx(MIXTRAL.active_params() - 32000 * 4096 - norms, rel=1e-12)
    # the preset's dense "layer" is one 14336-wide MLP: a MoE layer adds a second and the router
    assert f["moe_layer"] - f["layer"] == 2 * (3 * 4096 * 14336 + 8 * 4096)
    assert f["layers"] == 32 * f["moe_layer"]
    assert estimate_cost(MIXTRAL, plan.replace(ep=8), H100).as_dict()["flops_convention"] \
        .endswith("MoE layers: active parameters (router, top_k routed and the shared experts)")


# ----------------------------------------------------------------------------- time

def test_all_to_all_is_a_pairwise_exchange():
    """(n-1) latencies and (n-1)/n of the buffer inside a node; across nodes the other nodes'
    share through the member's own NIC."""
    n, buf = 8, 64e6
    assert H100.collective_s("all_to_all", n, buf, 450e9) == pytest.approx(
        7 * H100.latency_s + buf * 7 / 8 / 450e9)
    across = H100.collective_s("all_to_all", 16, buf, 450e9, per_node=8)
    assert across == pytest.approx(15 * H100.internode_latency_s + buf * 8 / 16 / H100.internode_bw)
    assert H100.collective_s("all_to_all", 1, buf, 450e9) == 0.0


def test_four_all_to_alls_per_moe_layer_on_the_ep_links():
    """Per micro-batch: 2 forward + 2 backward per MoE layer of the rank's tokens (4 more wire
    bytes' worth with full recompute: 6), each of a2a_bytes; inside a node at ep=8 tp=1, across
    nodes at tp=2 (tp*ep = 16 > 8 GPUs per node) and then slower; not hidden behind compute."""
    plan = Plan(dp=8, ep=8, dtype="bf16", seq_len=4096, global_batch=8)
    one = a2a_bytes(4096, 4096, 2, 8, 2)
    assert ep_wire_bytes(MIXTRAL, plan) == 4 * 32 * one
    assert ep_wire_bytes(MIXTRAL, plan.replace(recompute="full")) == 6 * 32 * one
    assert members_per_node(plan, H100)["ep"] is None
    tp2 = plan.replace(tp=2, sequence_parallel=True)  # sp: each tp rank routes its s/tp tokens
    assert members_per_node(tp2, H100)["ep"] == 4
    whole = ep_time(MIXTRAL, plan.replace(tp=2), H100, 0, 450e9)  # no sp: all tokens on each
    assert whole["fwd"] == pytest.approx(
        2 * 32 * H100.all_to_all_s(8, a2a_buffer_bytes(4096, 4096, 2, 2), 450e9, per_node=4))
    intra = ep_time(MIXTRAL, plan, H100, 0, 450e9)
    assert intra["fwd"] == intra["bwd"] == pytest.approx(
        2 * 32 * H100.collective_s("all_to_all", 8, a2a_buffer_bytes(4096, 4096, 2, 2), 450e9))
    cross = ep_time(MIXTRAL, tp2, H100, 0, 450e9)
    assert cross["fwd"] == pytest.approx(  # half the tokens per rank (sp splits them) ...
        2 * 32 * H100.all_to_all_s(8, a2a_buffer_bytes(2048, 4096, 2, 2), 450e9, per_node=4))
    assert cross["fwd"] > intra["fwd"]  # ... but half of them leave through one NIC: slower
    est = estimate_cost(MIXTRAL, plan, H100)
    b = est.breakdown
    assert b["ep_comm"] == pytest.approx(intra["fwd"] + intra["bwd"]) and b["ep_comm"] > 0
    paid = sum(b[k] for k in ("compute", "tp_comm", "cp_comm", "ep_comm", "bubble", "pp_comm",
                              "dp_exposed", "optimizer"))
    assert est.step_time_s == pytest.approx(paid)  # the all-to-alls are paid whole, not hidden


def test_expert_gradients_reduce_over_their_own_group():
    """dp=8 ep=8: the experts' gradients have no other holder (edp = 1), so the dp traffic is the
    dense part's alone; ep=1 reduces all 46.7e9 gradients over the 8 ranks."""
    plan = Plan(dp=8, dtype="bf16", seq_len=4096, global_batch=8, zero=1)
    with_ep, without = (estimate_cost(MIXTRAL, plan.replace(ep=e), H100) for e in (8, 1))
    n, n_exp = without.memory.n_params, without.memory.detail["experts"]["n_params"]
    assert without.comm_bytes["dp"] / with_ep.comm_bytes["dp"] == pytest.approx(n / (n - n_exp))


# ----------------------------------------------------------------------------- planner

@pytest.mark.timeout(240)
def test_plan_mixtral_on_64_gpus_proposes_ep_layouts_that_fit_only_with_ep(capsys):
    """`mini3d plan --model mixtral-8x7b --gpus 64` (H100s, sequences of 4096, 64 per step): the
    search walks ep in {1, 2, 4, 8} (the divisors of 8 experts that divide dp*cp), the fastest
    layouts use ep > 1, and among them are layouts whose ep=1 twin does not fit (the experts'
    states are what ep divides). About 10 s of one core."""
    from mini3d.cost.planner import candidate_plans, expert_parallel_degrees

    assert expert_parallel_degrees(MIXTRAL, 4) == [1, 2, 4]
    assert expert_parallel_degrees(MIXTRAL, 2, cp=4) == [1, 2, 4, 8]
    assert expert_parallel_degrees(PRESETS["gpt-7b"], 8) == [1]
    assert {p.ep for p in candidate_plans(MIXTRAL, 16, 16, 4096, max_micro_batch=1)} == {1, 2, 4, 8}
    rc, text = cli(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--global-batch", "64",
                    "--seq-len", "4096", "--dtype", "bf16", "--gpu", "H100-80GB", "--top", "10",
                    "--json"], capsys)
    out = json.loads(text)
    assert rc == 0 and out["fits"]
    plans = [Plan(**c["plan"]) for c in out["candidates"]]
    assert plans[0].ep > 1, out["candidates"][0]["layout"]
    only_with_ep = [p for p in plans if p.ep > 1
                    and not estimate_memory(MIXTRAL, p.replace(ep=1)).fits(H100.memory_bytes)]
    assert only_with_ep, [c["layout"] for c in out["candidates"]]
    assert all(c["layout"].startswith(f"tp{p.tp} ep{p.ep} ") for c, p in
               zip(out["candidates"], plans) if p.ep > 1)


# ----------------------------------------------------------------------------- dry run

@pytest.mark.timeout(120)
def test_dry_run_prints_the_ep_axis_and_its_all_to_all_bytes(capsys):
    from mini3d.cli import main

    rc = main(["train", "--dry-run", "--family", "llama", "--kv-heads", "2", "--experts", "4",
               "--top-k", "2", "--dp", "4", "--ep", "2", "--micro-batches", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ep=2 (of dp x cp)" in out
    assert "ep groups (ep=2, 2 of 4 experts per rank): [0, 1] [2, 3]" in out
    assert "expert-data-parallel groups (the ranks holding the same experts, dp*cp/ep = 2): " \
           "[0, 2] [1, 3]" in out
    # tiny: 4 MoE layers, global batch 8 over dp=4 x 2 micro-batches = 1 sequence of 64 tokens
    sent = 2 * A2A_PER_LAYER * 4 * a2a_bytes(64, 64, 2, 2, 4)
    # pp=1: one stage, not named; 5 all-to-alls a layer and micro-batch (the counts exchange too)
    assert f"40 all-to-alls on the ep group, sending {sent / 2**20:,.2f} MiB ({sent:,.0f} B, 4 MoE " \
           f"layers)" in out
    assert f"ep {sent:,.0f} B" in out  # the per-axis line, from the estimate


# ----------------------------------------------------------------------------- model cards

# Published totals / activated parameters, from each model card on the Hugging Face Hub:
# mistralai/Mixtral-8x7B-v0.1 (46.7B total, 12.9B active: Mixtral of Experts, Jiang et al. 2024,
# sec. 2.1), mistralai/Mixtral-8x22B-v0.1 (141B, 39B: Mistral's announcement "Cheaper, Better,
# Faster, Stronger", 2024), Qwen/Qwen3-30B-A3B (30.5B total, 3.3B activated, 29.9B
# non-embedding) and Qwen/Qwen3-235B-A22B (235B, 22B, 234B non-embedding).
CARDS = {"mixtral-8x7b": (46.7e9, 12.9e9, None), "mixtral-8x22b": (141e9, 39e9, None),
         "qwen3-30b-a3b": (30.5e9, 3.3e9, 29.9e9), "qwen3-235b-a22b": (235e9, 22e9, 234e9)}


@pytest.mark.parametrize("name", CARDS)
def test_estimate_json_params_match_the_model_cards(name, capsys):
    """`mini3d estimate --model NAME --json`: params within 0.5% of the card, and so the Mixtrals'
    active parameters and the Qwen3 non-embedding totals. The Qwen3 cards give the activated
    count to two digits (3.3B, 22B) and truncate it: 3.353e9 and 22.19e9 here (an untied
    151936 x d embedding and head, 48 / 94 layers of q/k/v/o, router and 8 experts), so that
    number is checked to its printed digits: card <= ours < card + one unit of its last digit."""
    total, active, non_embedding = CARDS[name]
    rc, text = cli(["estimate", "--model", name, "--dtype", "bf16", "--json"], capsys)
    out = json.loads(text)
    assert rc == 0
    assert abs(out["params"] / total - 1) < 0.005, out["params"]
    cfg = PRESETS[name]
    if non_embedding is None:
        assert abs(out["active_params"] / active - 1) < 0.005, out["active_params"]
    else:
        embedding = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
        assert abs((out["params"] - embedding) / non_embedding - 1) < 0.005
        unit = 0.1e9 if active < 10e9 else 1e9
        assert active <= out["active_params"] < active + unit, out["active_params"]
