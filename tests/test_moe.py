"""The mixture-of-experts block (mini3d.models.moe) against transformers' own MoE blocks, its
grouped GEMM against the loop, its capacity rule, and the exact parameter counts.

Tolerances: float32, the same matmuls in a different summation order (a token's k expert outputs
are added in another order, the grouped kernel may block differently): 1e-5 relative / 1e-6
absolute on outputs of size ~1e-1.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mini3d.models import balance, moe, routers
from mini3d.models.config import ModelConfig
from mini3d.models.families import ROUTERS
from mini3d.models.presets import PRESETS
from mini3d.models.transformer import GPT, MLP, ACTIVATIONS

TOL = dict(rtol=1e-5, atol=1e-6)


def tiny(**kw) -> ModelConfig:
    base = dict(n_layers=2, d_model=16, n_heads=2, vocab_size=32, max_seq_len=8, d_ff=32,
                family="llama", n_experts=4, top_k=2)
    return ModelConfig(**{**base, **kw})


def make_moe(cfg: ModelConfig, seed: int = 0) -> moe.MoE:
    torch.manual_seed(seed)
    m = moe.MoE(cfg, ACTIVATIONS[cfg.activation], MLP)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def hf_block(kind: str, cfg: ModelConfig, ours: moe.MoE, norm_topk: bool = True):
    """transformers' Mixtral / Qwen3-MoE block with our weights mapped in (gate_up = [gate; up])."""
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        hc = MixtralConfig(hidden_size=cfg.d_model, intermediate_size=cfg.moe_width,
                           num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        hc = Qwen3MoeConfig(hidden_size=cfg.d_model, moe_intermediate_size=cfg.moe_width,
                            num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                            norm_topk_prob=norm_topk)
    block = Block(hc)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        e = ours.experts
        block.experts.gate_up_proj.copy_(torch.cat([e.w_gate, e.w_up], dim=1))
        block.experts.down_proj.copy_(e.w_down)
    return block


@pytest.mark.parametrize("kind,router", [("mixtral", "softmax-norm"), ("qwen3", "softmax-norm"),
                                         ("qwen3", "softmax")])
def test_block_matches_transformers(kind, router):
    cfg = tiny(router=router, n_experts=8, top_k=2 if kind == "mixtral" else 3)
    ours = make_moe(cfg, seed=1)
    theirs = hf_block(kind, cfg, ours, norm_topk=router == "softmax-norm")
    x = torch.randn(3, 5, cfg.d_model)
    y = ours(x)
    torch.testing.assert_close(y, theirs(x), **TOL)
    logits, _, _ = theirs.gate(x.reshape(-1, cfg.d_model))
    torch.testing.assert_close(ours.stats["logits"], logits, **TOL)


def test_aux_loss_matches_transformers_pooled_over_layers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = tiny(n_layers=3, n_experts=6, top_k=2, aux_loss_coef=1.0, router="softmax-norm")
    model = GPT(cfg, seed=3)
    with torch.no_grad():  # spread the routers so that the loss is far from its balanced value
        for b in model.blocks.values():
            b.mlp.router.weight.normal_(0, 1.0)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    model(x)
    logits = tuple(b.mlp.stats["logits"] for b in model.blocks.values())
    want = load_balancing_loss_func(logits, cfg.n_experts, cfg.top_k)
    got = balance.router_loss(model)
    torch.testing.assert_close(got, want, **TOL)
    assert float(got.detach()) > cfg.top_k * 1.01  # unbalanced: above its floor top_k


def test_z_loss_and_coefficients_join_the_loss():
    cfg = tiny(z_loss_coef=0.5, aux_loss_coef=0.25)
    model = GPT(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    total = model(x, x)
    layers = balance.moe_layers(model)
    z = sum(torch.logsumexp(m.stats["logits"], -1).square().mean() for m in layers) / len(layers)
    dense_ce = GPT(dataclasses.replace(cfg, z_loss_coef=0.0, aux_loss_coef=0.0), seed=0)(x, x)
    aux = balance.router_loss(model) - 0.5 * z
    torch.testing.assert_close(total, dense_ce + 0.5 * z + aux, **TOL)
    assert float(aux.detach()) > 0.2  # 0.25 x a switch loss near its floor top_k = 2


def test_grouped_gemm_equals_loop(monkeypatch):
    cfg = tiny(d_model=16, moe_ffn=32, n_experts=4, n_shared_experts=1)
    ours = make_moe(cfg, seed=2)
    x = torch.randn(2, 8, cfg.d_model, requires_grad=True)
    have = moe.grouped_mm_supported(x, ours.experts.w_up, ours.experts.w_down)
    assert have == hasattr(torch, "_grouped_mm")  # this torch's CPU kernel takes float32
    outs = []
    for enabled in (True, False):
        monkeypatch.setitem(moe.GROUPED_MM, "enabled", enabled)
        y = ours(x)
        g = torch.autograd.grad(y.square().sum(), [x, *ours.parameters()])
        outs.append((y, g))
    torch.testing.assert_close(outs[0][0], outs[1][0], **TOL)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, **TOL)
    assert not moe.grouped_mm_supported(x.double(), ours.experts.w_up.double())
    assert not moe.grouped_mm_supported(x[..., :6], ours.experts.w_up[..., :6])  # 24-byte rows


def test_capacity_drops_the_lowest_weighted_assignments():
    cfg = tiny(n_experts=4, top_k=2, capacity_factor=0.5, router="softmax-norm")
    ours = make_moe(cfg, seed=4)
    x = torch.randn(1, 16, cfg.d_model)
    ours(x)
    cap = math.ceil(0.5 * 16 * 2 / 4)
    assert moe.capacity(cfg, 16) == cap == 4
    sel, counts = ours.stats["selected"], ours.stats["counts"]
    assert torch.equal(counts, sel.clamp(max=cap))
    assert ours.stats["dropped"] == int((sel - sel.clamp(max=cap)).sum()) > 0
    # the rule itself: expert 0 holds weights .9 .1 .5 .7 with capacity 2 -> keeps .9 and .7
    experts = torch.tensor([0, 0, 0, 0, 1])
    keep = moe.keep_within_capacity(experts, torch.tensor([.9, .1, .5, .7, .2]), 2)
    assert keep.tolist() == [True, False, False, True, True]


def test_sigmoid_router_bias_steers_choice_not_weights():
    cfg = tiny(router="sigmoid", n_experts=4, top_k=1, router_bias_rate=0.1)
    ours = make_moe(cfg, seed=5)
    x = torch.randn(1, 8, cfg.d_model)
    ours.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))  # every token to expert 3
    ours(x)
    assert ours.stats["selected"].tolist() == [0, 0, 0, 8]
    y = ours(x)
    only3 = ours.experts(x.reshape(-1, cfg.d_model), torch.tensor([0, 0, 0, 8]))
    torch.testing.assert_close(y.reshape(-1, cfg.d_model), only3, **TOL)  # weight 1 (renormalised)
    assert "expert_bias" in ours.state_dict() and "expert_bias" not in dict(ours.named_parameters())


def test_bias_update_and_step_load():
    cfg = tiny(router="sigmoid", n_experts=4, top_k=1, router_bias_rate=0.1, n_layers=1)
    model = GPT(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    model(x, x)
    counts = model.blocks["0"].mlp.stats["counts"].clone()
    rep = balance.step_load(model)
    assert rep["expert_load_min"] == int(counts.min()) and rep["expert_load_max"] == int(counts.max())
    assert rep["dropped_tokens"] == 0 and sum(counts.tolist()) == 16
    assert rep["expert_load"] == counts.tolist()  # the per-expert record --log-jsonl writes
    want = 0.1 * torch.sign(counts.double().mean() - counts.double()).float()
    torch.testing.assert_close(model.blocks["0"].mlp.expert_bias, want)
    assert balance.step_load(model) == {}  # reset after each step


@pytest.mark.parametrize("kw", [
    dict(family="llama", n_experts=4, top_k=2),
    dict(family="llama", n_experts=8, top_k=2, moe_ffn=24, n_shared_experts=2, dense_layers=1),
    dict(family="gpt2", n_experts=4, top_k=1, moe_every=2, n_shared_experts=1, tie_embeddings=True),
    dict(family="gpt2", n_experts=3, top_k=3, moe_ffn=8, router="sigmoid"),
])
def test_counts_exact_for_the_built_model(kw):
    cfg = ModelConfig(n_layers=4, d_model=16, n_heads=2, vocab_size=40, max_seq_len=8, **kw)
    model = GPT(cfg, init=False)
    assert cfg.n_params() == sum(p.numel() for p in model.parameters())
    per_token = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            per_token += p.numel() * cfg.top_k // cfg.n_experts  # top_k of E stacked experts
        else:
            per_token += p.numel()
    assert cfg.active_params() == per_token
    assert (cfg.active_params() < cfg.n_params()) == (cfg.top_k < cfg.n_experts)
    dense = dataclasses.replace(cfg, n_experts=0)
    assert dense.n_params() == dense.active_params() == sum(p.numel() for p in GPT(dense, init=False).parameters())


def test_routers_registry_is_the_configs_list():
    assert tuple(routers.ROUTERS) == ROUTERS


# Published totals / active parameters (B): Mixtral 8x7B "46.7B total, 12.9B active"
# (mistral.ai/news/mixtral-of-experts); Mixtral 8x22B "141B, 39B active"
# (mistral.ai/news/mixtral-8x22b); Qwen3-30B-A3B "30.5B, 3.3B activated" and Qwen3-235B-A22B
# "235B, 22B activated" (their Hugging Face model cards). A card's figure is rounded to its last
# digit, so the tolerance is 0.5% or half a unit of that digit, whichever is larger.
CARDS = {"mixtral-8x7b": (46.7, 12.9), "mixtral-8x22b": (141, 39),
         "qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235, 22)}


def _close(got_b: float, card: float) -> bool:
    digits = len(str(card).split(".")[1]) if "." in str(card) else 0
    # or truncated to that digit: Qwen3-30B-A3B's 3.353e9 activated parameters read "3.3B" (its
    # 29.91e9 non-embedding ones "29.9B"), attention 48 x 18.9M + 8 experts 48 x 37.7M + embeddings
    truncated = 0 <= got_b - card < 10 ** -digits
    return truncated or abs(got_b - card) <= max(0.005 * card, 0.5 * 10 ** -digits)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_presets_match_model_cards(name):
    cfg = PRESETS[name]
    if name.startswith("qwen3"):  # the qwen3 family's attention: heads 128 wide, q/k norms
        assert (cfg.family, cfg.head_dim, cfg.qk_norm) == ("qwen3", 128, True)
    total, active = CARDS[name]
    assert _close(cfg.n_params() / 1e9, total), (cfg.n_params(), total)
    assert _close(cfg.active_params() / 1e9, active), (cfg.active_params(), active)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_estimate_json_reports_params_and_active_params(name, capsys):
    import json

    from mini3d import cli

    assert cli.main(["estimate", "--model", name, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = PRESETS[name]
    assert (out["params"], out["active_params"]) == (cfg.n_params(), cfg.active_params())
    assert _close(out["params"] / 1e9, CARDS[name][0]) and _close(out["active_params"] / 1e9,
                                                                   CARDS[name][1])


def test_moe_flags_reach_the_model(capsys):
    import json

    from mini3d import cli

    assert cli.main(["estimate", "--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "256",
                     "--family", "llama", "--experts", "8", "--top-k", "2", "--moe-ffn", "32",
                     "--shared-experts", "1", "--dense-layers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = ModelConfig(4, 64, 4, 256, family="llama", n_experts=8, top_k=2, moe_ffn=32,
                      n_shared_experts=1, dense_layers=1)
    assert (out["params"], out["active_params"]) == (cfg.n_params(), cfg.active_params())
    assert out["params"] != ModelConfig(4, 64, 4, 256, family="llama").n_params()


@pytest.mark.parametrize("flags,named", [(["--router", "foo"], "router='foo' is unknown"),
                                         (["--top-k", "5"], "top_k=5 exceeds n_experts=4"),
                                         (["--router-bias-rate", "0.1"], "needs router='sigmoid'")])
def test_bad_moe_input_exits_2(flags, named, capsys):
    from mini3d import cli

    assert cli.main(["train", "--experts", "4", "--steps", "1", *flags]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_keeps_loss_and_gradients(recompute):
    from mini3d.recompute import apply_recompute

    cfg = tiny(aux_loss_coef=0.1, z_loss_coef=0.01, capacity_factor=1.0)
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    out = []
    for kind in ("none", recompute):
        model = apply_recompute(GPT(cfg, seed=0), kind)
        loss = model(x, x)
        loss.backward()
        out.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=0)
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_expert_loop_without_rows_stays_in_the_graph():
    """A rank whose experts got no rows (the loop path: float64, or no grouped kernel) must still
    run their backward, or under ep it skips the combine's backward all-to-all that its peers
    enter: the combination matrix's tp2 pp2 dp2 ep2 full-recompute float64 case hung so."""
    from mini3d.models.moe import expert_matmul

    x = torch.zeros(0, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    y = expert_matmul(x, w, torch.zeros(3, dtype=torch.long), grouped=False)
    assert y.shape == (0, 5) and y.grad_fn is not None
    y.sum().backward()
    assert x.grad.shape == (0, 4) and torch.equal(w.grad, torch.zeros_like(w))
