"""The deepseek family's costs (issue #31): multi-head latent attention's activations against the
saved-tensor ledger (one process and tp=2), the KV cache per token (full heads, GQA, MLA's latent)
against mini3d's own cache buffers, and node-limited routing's nodes per token against the
closed form of plain top-k."""

from __future__ import annotations

import dataclasses
from math import comb

import pytest
import torch

from mini3d.config import PRESETS, ModelConfig, Plan
from mini3d.cost.activations import layer_activation_bytes, mla_activation_bytes
from mini3d.cost.kv_cache import kv_cache_bytes, kv_cache_elements
from mini3d.cost.moe import internode_bytes, nodes_reached

# every width differs (q latent 12, kv latent 8, heads 6 + 4 rotary wide for q/k and 10 for v),
# DeepSeek's interleaved rotary layout, YaRN (its q scale and cos/sin amplitude)
MLA = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=256, max_seq_len=16, d_ff=48,
                  family="deepseek", q_lora_rank=12, kv_lora_rank=8, qk_rope_dim=4, qk_nope_dim=6,
                  v_head_dim=10, rope_interleave=True, yarn=(4.0, 8, 32, 1, 0.707, 1.0), name="mla-test")
B, S = 2, 16
CASES = [("none", "explicit"), ("selective", "explicit"), ("full", "explicit"), ("none", "sdpa")]


def small_terms(cfg: ModelConfig, recompute: str, attention: str, s: int = S, b: int = B) -> int:
    """The float32 bytes `layer_activation_bytes` leaves out (its docstring): each RMSNorm's rstd
    (the block's two, the latents' one or two), the four rotary cos/sin tables (q's and k's) and
    the explicit core's causal mask (not ring attention's); nothing but the block input under full
    recompute."""
    if recompute == "full":
        return 0
    norms = 2 + 1 + (1 if cfg.q_lora_rank else 0)
    mask = s * s if (attention == "explicit" and recompute == "none") else 0
    return norms * 4 * s * b + 4 * s * cfg.qk_rope_dim * 4 + mask


@pytest.mark.timeout(60)
@pytest.mark.parametrize("q_lora_rank", [12, 0], ids=["q-latent", "full-q"])
@pytest.mark.parametrize("recompute,attention", CASES)
def test_mla_activations_equal_the_saved_tensor_ledger(q_lora_rank, recompute, attention):
    """One forward of a 2-layer deepseek model under the ledger: every block keeps exactly what
    `layer_activation_bytes` counts plus `small_terms`, to the byte. Counting the latents as
    llama's q/k/v (the estimate before MLA had terms of its own) missed by 14%; dividing the
    latents by tp misses the tp=2 test below."""
    from mini3d.models.attention import set_attention
    from mini3d.models.transformer import GPT
    from mini3d.recompute import apply_recompute, measure_activations

    cfg = dataclasses.replace(MLA, q_lora_rank=q_lora_rank)
    plan = Plan(global_batch=B, seq_len=S, recompute=recompute, attention=attention)
    torch.manual_seed(0)
    model = apply_recompute(set_attention(GPT(cfg), attention), recompute)
    x = torch.randint(0, cfg.vocab_size, (B, S))
    with measure_activations(model) as led:
        model(x, x)
    est = layer_activation_bytes(cfg, plan)["stored"] + small_terms(cfg, recompute, attention)
    assert [led.layer_bytes(i) for i in range(cfg.n_layers)] == [est] * cfg.n_layers


@pytest.mark.timeout(180)
def test_mla_activations_under_tp2_and_cp2():
    """tp=2 and cp=2 through the trainer (one launch, both cores): under tp each rank's blocks
    keep the latents whole and half of the heads' q, k, v and scores, as `mla_activation_bytes`
    says; under cp each keeps its s/cp tokens' terms, and ring attention v padded to k's width
    and its float32 output and log-sum-exp (no s x s matrix, no causal mask)."""
    from mini3d.launch.launcher import launch
    from mini3d.run.train import make_spec
    from tests.threed_workers import run_specs

    plans = [Plan(tp=2, global_batch=B, seq_len=S, attention=a) for a in ("explicit", "sdpa")]
    plans.append(Plan(cp=2, global_batch=B, seq_len=S))
    specs = [make_spec(MLA, p, steps=1, collect=["activations"]) for p in plans]
    ranks = launch(run_specs, 2, specs, device="cpu", timeout=150)
    for plan, runs in zip(plans, zip(*ranks)):
        ring = plan.cp > 1
        est = layer_activation_bytes(MLA, plan)["stored"] + small_terms(
            MLA, "none", "ring" if ring else plan.attention, s=S // plan.cp)
        for r in runs:
            got = [sum(v for k, v in r["activations"].items() if k.startswith(f"layer{i}."))
                   for i in range(MLA.n_layers)]
            assert got == [est] * MLA.n_layers, (plan.attention, got, est)
    one, two = (mla_activation_bytes(MLA, Plan(tp=t, global_batch=B, seq_len=S), False) for t in (1, 2))
    assert two["latents"] == one["latents"] and two["heads"] == one["heads"] / 2


# ----------------------------------------------------------------------------- the KV cache

def _cached_bytes(cfg: ModelConfig, n: int) -> int:
    """Bytes of the k and v buffers mini3d's KV cache holds after decoding `n` positions."""
    from mini3d.models.kv_cache import KVDecoder
    from mini3d.models.transformer import GPT

    torch.manual_seed(0)
    model = GPT(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (1, n))
    with torch.no_grad(), KVDecoder(model) as decode:
        decode(x)
        return sum(blk.attn.core.nbytes for blk in model.blocks.values())


@pytest.mark.timeout(60)
def test_kv_cache_bytes_are_what_the_cache_holds():
    """mini3d's cache (capacity max_seq_len) holds kv_cache_bytes of its attention: full heads
    (gpt2), GQA (llama, 2 of 4 heads), and for deepseek the latent (8 + 4 numbers a token and
    layer, not the expanded heads' n_heads * (qk 10 + v 10))."""
    gpt2 = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=64, max_seq_len=16)
    llama = dataclasses.replace(gpt2, family="llama", n_kv_heads=2, d_ff=48)
    for cfg, kind in ((gpt2, "full"), (llama, "gqa"), (MLA, "mla")):
        assert _cached_bytes(cfg, 5) == kv_cache_bytes(cfg, 16, element_bytes=4, kind=kind), cfg.family
    assert kv_cache_elements(MLA) == 8 + 4 and kv_cache_elements(MLA, "full") == 4 * (10 + 10)
    assert kv_cache_elements(llama) == kv_cache_elements(llama, "gqa") == 2 * 2 * 8


def test_deepseek_v3_latent_is_576_numbers_a_token_a_layer():
    """DeepSeek-V2's paper, table 1: MLA caches (d_c + d_h^R) = 512 + 64 per token per layer,
    against 2 n_h d_h for full heads (here with q/k 192 and v 128 wide: 128 x 320 = 40,960) and
    2 n_g d_h for GQA with Llama's 8 groups (2,560)."""
    v3 = PRESETS["deepseek-v3"]
    assert [kv_cache_elements(v3, k, kv_heads=8) for k in ("mla", "gqa", "full")] == [576, 2560, 40960]
    assert kv_cache_bytes(v3, 4096, kind="mla") == 61 * 4096 * 576 * 2  # bf16, one sequence
    with pytest.raises(ValueError, match="kind='mqa'"):
        kv_cache_elements(v3, "mqa")


# ----------------------------------------------------------------------------- node-limited routing

def test_nodes_reached_by_plain_top_k_match_the_closed_form():
    """Plain top-k of random scores picks a uniform k-subset of the E experts: a node of E/N
    experts is missed with probability C(E - E/N, k) / C(E, k), so N (1 - that) nodes are reached
    on average. The router's 8192 tokens land within 0.05 of it (the standard error is ~0.01)."""
    for E, k, n in ((256, 8, 8), (64, 6, 4)):
        got = nodes_reached(E, k, n)
        expected = n * (1 - comb(E - E // n, k) / comb(E, k))
        assert got["mean"] == pytest.approx(expected, abs=0.05), (E, k, n, got)
        assert got["remote"] == pytest.approx(got["mean"] * (n - 1) / n)


def test_node_limited_routing_caps_the_nodes_and_the_bytes():
    """DeepSeek-V3 (256 experts, top 8 within the best 4 of 8 groups, a group per node): no token
    reaches more than 4 nodes (5.3 on average without the limit, up to 8); all 8 groups allowed is
    plain top-k, token for token. The inter-node bytes follow the remote nodes."""
    free, limited = nodes_reached(256, 8, 8), nodes_reached(256, 8, 8, groups=8, topk_groups=4)
    assert limited["max"] == 4 < free["max"] and 3.5 < limited["mean"] < 4 < 5 < free["mean"]
    assert nodes_reached(256, 8, 8, groups=8, topk_groups=8) == free
    assert internode_bytes(4096, 7168, 2, limited["remote"]) == 4096 * limited["remote"] * 7168 * 2
    with pytest.raises(ValueError, match="nodes=3"):
        nodes_reached(256, 8, 3)


# ----------------------------------------------------------------------------- DeepSeek-V3 on H100 / H200 nodes

@pytest.mark.timeout(120)
@pytest.mark.parametrize("gpus,gpu", [(256, "H200-141GB"), (1024, "H100-80GB")])
def test_planner_fits_deepseek_v3_on_h100_and_h200_nodes(gpus, gpu):
    """671B (654B of it routed experts) on 256 H200s / 1024 H100s, one 4096-token sequence per GPU
    per step, bf16, flash attention: the planner finds layouts that fit (micro-batches of one
    sequence, to keep the search to a few seconds), each under the card's memory by the
    estimator's own count, and every one splits the experts (ep > 1). `mini3d estimate`'s stage
    lines give the routed experts' share of the model states, per ep rank."""
    from mini3d.cost.hardware import PRESETS as GPUS
    from mini3d.cost.memory import estimate_memory
    from mini3d.cost.planner import search

    cfg, hw = PRESETS["deepseek-v3"], GPUS[gpu]
    found = search(cfg, gpus, hw, gpus, 4096, attention="sdpa", max_micro_batch=1, suggest=False)
    assert found.candidates and found.n_fit > 0
    for c in found.candidates:
        mem = estimate_memory(cfg, c.plan)
        assert mem.total == c.memory.total < hw.memory_bytes and c.plan.world_size == gpus
        assert c.plan.ep > 1
        x = mem.detail["experts"]
        assert f"routed experts' {x['n_params'] / 1e9:.2f}e9 parameters" in mem.summary()


def test_estimate_states_what_active_params_count(capsys):
    """The card's "37B activated" against mini3d's 37.55e9: `estimate` says what its count holds
    (embedding, head, attention, dense layers, router, routed and shared experts) and gives it
    without the input embedding too, 36.63e9 (tests/test_deepseek.py pins both against the card)."""
    import json

    from mini3d import cli

    assert cli.main(["estimate", "--model", "deepseek-v3", "--json"]) == 0
    (note,) = [n for n in json.loads(capsys.readouterr().out)["notes"] if n.startswith("active_params")]
    assert "37.55e9" in note and "36.63e9" in note and "shared experts" in note and "router" in note
    assert cli.main(["estimate", "--model", "llama-3.1-8b", "--json"]) == 0
    assert "notes" not in json.loads(capsys.readouterr().out)  # a dense model: active = all


@pytest.mark.timeout(60)
@pytest.mark.parametrize("routing", [dict(router="sigmoid"),
                                     dict(router="sigmoid", route_groups=4, route_topk_groups=2,
                                          routed_scaling_factor=2.5)], ids=["sigmoid", "grouped"])
def test_deepseek_moe_block_equals_the_ledger(routing):
    """A deepseek MoE block (MLA + shared expert + DeepSeek-V3's sigmoid routers): the mixture keeps
    `moe_activation_bytes` plus its input within 1% (what is left out: the int32 counts per expert
    and the renormalisation's sums, `router_activation_bytes`); counting the sigmoid routers as
    the softmax one (4nE + 8nk, before their terms) missed the grouped router by 5.6%. The whole
    block is the MLA terms (exact, with `small_terms`) plus that."""
    from mini3d.cost.activations import moe_activation_bytes
    from tests.test_cost_moe import measured_ledger

    cfg = dataclasses.replace(MLA, max_seq_len=64, n_experts=8, top_k=2, moe_ffn=16, dense_layers=1,
                              n_shared_experts=1, **routing)
    plan = Plan(global_batch=2, seq_len=64)
    led = measured_ledger(cfg)
    measured = led.by_category["layer1.mlp"]
    assert abs(moe_activation_bytes(cfg, plan) + 2 * 64 * cfg.d_model * 4 - measured) < 0.01 * measured
    est = layer_activation_bytes(cfg, plan, moe=True)["stored"] + small_terms(cfg, "none", "explicit", 64, 2)
    assert abs(est - led.layer_bytes(1)) < 0.005 * led.layer_bytes(1)
