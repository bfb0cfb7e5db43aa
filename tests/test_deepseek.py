"""The deepseek family (issue #31): multi-head latent attention and DeepSeek-V3's grouped sigmoid
routing equal transformers' DeepseekV3ForCausalLM on the same weights (logits, loss, every
gradient), its directories import, sample what `generate` samples and export back exactly, the
parameter counts are those of the built model, and the presets those of the model cards. Tiny
random configs built here; nothing is downloaded."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mini3d.config import PRESETS, ModelConfig
from mini3d.models.routers import GroupedSigmoidRouter
from mini3d.models.transformer import GPT

V, T = 97, 12


def ds_config(**kw):
    """A tiny DeepseekV3: 3 layers, the first dense; 8 experts in 4 groups, tokens limited to the
    best 2 groups, top 3, one shared expert, scaling 2.5; q latent 24, kv latent 16, heads
    16 + 8 (rotary) wide for q/k and 12 for v (so every width differs)."""
    transformers = pytest.importorskip("transformers")
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=8,
                routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                first_k_dense_replace=1, max_position_embeddings=64, rope_theta=1e4,
                tie_word_embeddings=False,
                eos_token_id=None)  # (DeepseekV3Config's default is 1: generate's min_new_tokens
    #                                would mask that id, which mini3d sample does not)
    return transformers.DeepseekV3Config(**{**base, **kw})


CONFIGS = {
    "v3": lambda: ds_config(),
    # V2-Lite's attention (no query latent), the rotate-half layout, scores not renormalised
    "full-q-no-interleave-unnormalised": lambda: ds_config(q_lora_rank=None, rope_interleave=False,
                                                           norm_topk_prob=False),
    "tied-one-group": lambda: ds_config(n_group=1, topk_group=1, tie_word_embeddings=True),
    # DeepSeek-V3's YaRN, over a context short enough that the ramp lands inside the 4 rotary
    # frequencies, and mscale != mscale_all_dim so that both the attention factor on cos / sin
    # and the softmax scale differ from 1
    "yarn": lambda: ds_config(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}),
}


def hf_model(hf_cfg, seed=0, attention_scale=1.0):
    import transformers

    torch.manual_seed(seed)
    hf_cfg._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(hf_cfg).float()
    with torch.no_grad():  # random norms and biases too, so that every mapping matters
        for name, p in model.named_parameters():
            p.add_(0.02 * torch.randn_like(p))
            if any(k in name for k in ("q_proj", "q_b_proj", "kv_a_proj", "kv_b_proj")):
                p.mul_(attention_scale)  # 10: scores of order 1, not 0.05, so positions show
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change the choice
                b.copy_(0.05 * torch.randn_like(b))
    return model


def saved(hf_cfg, path, attention_scale=1.0):
    model = hf_model(hf_cfg, attention_scale=attention_scale)
    model.save_pretrained(path, safe_serialization=True)
    return model


def mini3d_model(path) -> GPT:
    from mini3d.checkpoint.hf import read_hf_dir

    cfg, weights = read_hf_dir(str(path))
    model = GPT(cfg, init=False)
    with torch.no_grad():  # every parameter (a tied head once) and the routers' biases
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            t.copy_(weights[n])
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_gradients_equal_transformers(name, tmp_path):
    pytest.importorskip("safetensors")
    from mini3d.checkpoint.hf import from_hf_state, to_hf_state

    # q and k 10x the init's: attention scores of order 1, so that a wrong rotary frequency
    # (YaRN's) or layout shows in the logits (at the init's scale, scores of 0.05 hide it)
    hf = saved(CONFIGS[name](), tmp_path, attention_scale=10.0)
    mini = mini3d_model(tmp_path)
    assert mini.cfg.family == "deepseek" and mini.cfg.n_experts == 8
    x = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))
    # float32, same weights and the same expert choices: only summation order differs
    assert (mini(x) - hf(x).logits).abs().max() < 1e-5
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    for step in range(2):  # the first step's gradients, then after one AdamW update
        ref = hf(x, labels=x).loss
        loss = mini(x[:, :-1], x[:, 1:])
        assert abs(loss.item() - ref.item()) < 1e-5, (step, loss.item(), ref.item())
        ref.backward()
        loss.backward()
        want = {n: p.grad for n, p in hf.named_parameters()}
        got = to_hf_state({n: p.grad for n, p in mini.named_parameters()}, mini.cfg, layout="fused")
        got.pop("lm_head.weight", None) if mini.cfg.tie_embeddings else None
        assert set(want) == set(got)
        for n, g in want.items():
            err = float((got[n] - g).abs().max() / (g.abs().max() + 1e-12))
            assert err < 1e-4, (step, n, err)  # relative to the tensor's largest entry
        opt.step()
        opt.zero_grad()
        mini.zero_grad()
        with torch.no_grad():
            new = from_hf_state(hf.state_dict(), mini.cfg)
            for n, p in mini.named_parameters():
                p.copy_(new[n])


def test_grouped_router_keeps_each_token_within_its_best_groups():
    """8 experts in 4 groups, top 2 groups: a token whose single best expert sits in a group whose
    second best is poor goes elsewhere (the group score is the sum of its top two)."""
    logits = torch.full((1, 8), -4.0)
    logits[0, 0] = 4.0  # group 0: one excellent expert, one poor
    logits[0, 2:4] = 1.0  # group 1: two good ones
    logits[0, 4:6] = torch.tensor([0.6, 0.5])  # group 2: two fair ones
    r = GroupedSigmoidRouter(groups=4, topk_groups=2, scale=2.5, norm=True)
    w, e, _ = r.route(logits, 3, torch.zeros(8))
    assert sorted(e[0].tolist()) == [2, 3, 4]  # groups 1 and 2; expert 0 excluded
    assert abs(float(w.sum()) - 2.5) < 1e-6  # renormalised, then scaled
    ungrouped = GroupedSigmoidRouter(groups=1, topk_groups=1, scale=1.0, norm=False)
    w, e, _ = ungrouped.route(logits, 3, torch.zeros(8))
    assert 0 in e[0].tolist() and abs(float(w.sum()) - float(torch.sigmoid(logits)[0, e[0]].sum())) < 1e-6


@pytest.mark.parametrize("kw", [
    dict(),
    dict(q_lora_rank=12, tie_embeddings=True),
    dict(q_lora_rank=12, n_experts=4, top_k=2, n_shared_experts=1, dense_layers=1, router="sigmoid",
         route_groups=2, route_topk_groups=1, moe_ffn=8),
])
def test_counts_exact_for_the_built_model(kw):
    cfg = ModelConfig(n_layers=3, d_model=16, n_heads=2, vocab_size=40, max_seq_len=8,
                      family="deepseek", kv_lora_rank=6, qk_rope_dim=4, qk_nope_dim=6,
                      v_head_dim=5, **kw)
    model = GPT(cfg, init=False)
    assert not cfg.problems()
    assert cfg.n_params() == sum(p.numel() for p in model.parameters())
    per_token = sum(p.numel() * (cfg.top_k / cfg.n_experts if ".experts." in n else 1)
                    for n, p in model.named_parameters())
    assert cfg.active_params() == per_token


@pytest.mark.parametrize("change,named", [
    (dict(n_kv_heads=2), "n_kv_heads=2 != n_heads=4"),
    (dict(qk_rope_dim=5), "qk_rope_dim=5 must be even"),
    (dict(rope_scaling=(40.0, 1.0, 32.0, 4096)), "the deepseek family's is YaRN"),
    (dict(yarn=(40.0, 4096, 32.0)), "yarn=(40.0, 4096, 32.0) must be"),
    (dict(route_groups=3), "route_groups=3 must divide n_experts=8"),
    (dict(route_groups=4, route_topk_groups=1, top_k=3), "top_k=3 exceeds the 2 experts"),
    (dict(router="softmax"), "need router='sigmoid'"),
])
def test_bad_deepseek_shapes_are_named(change, named):
    base = dict(n_layers=2, d_model=32, n_heads=4, family="deepseek", n_experts=8, top_k=2,
                router="sigmoid", route_groups=4, route_topk_groups=2, routed_scaling_factor=2.5)
    problems = ModelConfig(**{**base, **change}).problems()
    assert any(named in p for p in problems), problems
    assert not ModelConfig(**base).problems()
    assert any("rope_interleave" in p for p in ModelConfig(family="llama", rope_interleave=True).problems())
    assert any("yarn" in p for p in ModelConfig(family="llama", yarn=(4.0, 16, 32, 1, 1, 1)).problems())


DS = ModelConfig(n_layers=3, d_model=16, n_heads=2, vocab_size=64, max_seq_len=16, d_ff=32,
                 family="deepseek", q_lora_rank=12, kv_lora_rank=8, qk_rope_dim=4, qk_nope_dim=6,
                 v_head_dim=5, rope_interleave=True, n_experts=8, top_k=2, moe_ffn=8,
                 n_shared_experts=1, dense_layers=1, router="sigmoid", route_groups=4,
                 route_topk_groups=2, routed_scaling_factor=2.5, router_bias_rate=0.05,
                 name="deepseek-test")


@pytest.mark.timeout(300)
def test_dp2_equals_one_process():
    """float32; dp's average against one rank's accumulation of the same micro-batches (the
    tolerances of tests/test_moe_train.py): losses, every step's gradients, final weights, the
    aux-loss-free biases and the expert load."""
    from tests.test_moe_train import dp2_matches_one_process

    one = dp2_matches_one_process(DS)
    assert any(".attn.kv_b." in n for n in one["params"])  # the latent attention trained


@pytest.mark.parametrize("flags,named", [(["--cp", "2", "--v-head-dim", "32"], "v_head_dim=32 <=")])
def test_splits_mla_does_not_have_yet_are_refused(flags, named, capsys):
    from mini3d import cli

    assert cli.main(["train", "--family", "deepseek", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "family='deepseek'" in err


DENSE = dataclasses.replace(DS, n_experts=0, router="softmax", route_groups=1, route_topk_groups=1,
                            routed_scaling_factor=1.0, router_bias_rate=0.0, n_layers=2, vocab_size=256,
                            name="deepseek-dense-test")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cfg", [DENSE, dataclasses.replace(DENSE, q_lora_rank=0, tie_embeddings=True)],
                         ids=["q-latent", "full-q-tied"])
def test_mla_under_tp2_and_pp2_equals_the_reference(cfg):
    """tp=2 (heads split: q_b / q and kv_b by rows, proj by columns; q_a, kv_a and the latent
    norms replicated, their gradients whole on each rank through `f`), tp=2 with sequence
    parallelism (the normed latents and the rotary key gathered along the sequence, the
    replicated parameters' gradients summed over tp by the trainer) and pp=2, in float64
    against the one-process model: test_3d's F64 bounds (summation order only). The replicated
    kv_a's gradient is the one a missing `f` on the shared rotary key would get wrong (each
    rank would keep only its heads' part); under sp a gather of the rotary key with `f`'s
    all-reduce left in would double it, one without the tp sum halve q_a's and kv_a's."""
    from mini3d.config import Plan
    from mini3d.launch.launcher import launch
    from tests.test_3d import F64, F64_BASE, SEED, STEPS, check_float32, reference
    from tests.threed_workers import run_layouts

    cases = [("tp2", Plan(tp=2, micro_batches=2, **F64_BASE)),
             ("tp2-sp", Plan(tp=2, sequence_parallel=True, micro_batches=2, **F64_BASE)),
             ("pp2", Plan(pp=2, micro_batches=2, **F64_BASE))]
    results = launch(run_layouts, 2, [{"name": n, "plan": dataclasses.asdict(p)} for n, p in cases],
                     dataclasses.asdict(cfg), STEPS, SEED, device="cpu", timeout=200)
    ref = reference(STEPS, cfg=cfg, dtype=torch.float64)
    assert all(ref[1][0][f"blocks.{i}.attn.kv_a.weight"].abs().max() > 0 for i in range(cfg.n_layers))
    for name, plan in cases:
        for r in (r for per_rank in results for r in per_rank if r["name"] == name):
            assert r["losses"] == pytest.approx(ref[0], abs=F64["loss"]), name
        check_float32(name, plan, results, ref, cfg=cfg, bounds=F64)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["v3", "full-q-no-interleave-unnormalised", "yarn"])
def test_import_samples_what_transformers_generates_and_exports_back(kind, tmp_path, capsys):
    """import-hf -> `mini3d sample` greedy (through the KV cache, whose v is narrower than k
    here) equals `generate`; export-hf -> DeepseekV3ForCausalLM loads it with every tensor
    bit-equal (the routers' correction biases included) and the same logits."""
    import transformers

    from tests.test_hf import round_trip_matches

    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    hf = saved(CONFIGS[kind]().__class__(**{**CONFIGS[kind]().to_dict(), "vocab_size": 256}), src,
               attention_scale=10.0).eval()  # (scores of order 1: positions show)
    round_trip_matches(hf, src, ckpt, out, transformers.DeepseekV3ForCausalLM, capsys)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["n_group"], cfg["routed_scaling_factor"]) == ("deepseek_v3", 4, 2.5)


def test_yarn_reads_and_other_variants_are_refused_naming_the_field():
    from mini3d.checkpoint.hf_config import HFError, config_from_hf, config_to_hf

    d = ds_config().to_dict()
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 1e4}
    assert config_from_hf({**d, "rope_parameters": yarn}).yarn == (40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    with pytest.raises(HFError, match="rope_scaling / rope_parameters of type 'yarn'"):
        config_from_hf({**d, "rope_parameters": {**yarn, "attention_factor": 1.2}})
    with pytest.raises(HFError, match="of type 'dynamic'"):
        config_from_hf({**d, "rope_parameters": {**yarn, "rope_type": "dynamic"}})
    with pytest.raises(HFError, match="attention_bias"):
        config_from_hf({**d, "attention_bias": True})
    cfg = config_from_hf(d)
    assert config_from_hf(config_to_hf(cfg), name=cfg.name) == cfg
    with pytest.raises(HFError, match="no Hugging Face class"):
        config_to_hf(dataclasses.replace(cfg, capacity_factor=1.25))


# Published totals / activated parameters (B): DeepSeek-V3 "671B total, 37B activated", without
# the 14B multi-token-prediction module (github.com/deepseek-ai/DeepSeek-V3, README, and its
# Hugging Face model card); DeepSeek-V2-Lite "15.7B total, 2.4B activated" (the DeepSeek-V2
# paper, arXiv 2405.04434, and its model card). The same tolerance as tests/test_moe.py's cards
# (0.5%, or within the card's last digit, rounded or truncated).
CARDS = {"deepseek-v3": (671, 37), "deepseek-v2-lite": (15.7, 2.4)}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_presets_match_model_cards(name, capsys):
    """params within 0.5% of the card (671.03e9, 15.706e9). active_params counts the embedding
    and the head too (the project's convention, tests/test_moe.py): deepseek-v3's 37.55e9 reads
    "37B" truncated (1.5% above 37.0: the card's figure is rounded to the unit). DeepSeek's cards
    leave the input embedding (a lookup, no matmul) out of "activated": without it V3 has
    36.63e9 ("37B") and V2-Lite 2.451e9 ("2.4B"), while V2-Lite's active_params with it, 2.66e9,
    is not the card's 2.4B, which is why that one is pinned without the embedding only."""
    from mini3d import cli
    from tests.test_moe import _close

    cfg = PRESETS[name]
    total, active = CARDS[name]
    assert _close(cfg.n_params() / 1e9, total) and abs(cfg.n_params() / 1e9 / total - 1) < 0.005
    assert _close((cfg.active_params() - cfg.vocab_size * cfg.d_model) / 1e9, active)
    assert cli.main(["estimate", "--model", name, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["params"], out["active_params"]) == (cfg.n_params(), cfg.active_params())
    if name == "deepseek-v3":
        assert _close(out["active_params"] / 1e9, active)
        assert any("MTP" in n for n in out["notes"])
        assert cli.main(["estimate", "--model", name]) == 0
        assert "MTP" in capsys.readouterr().out


def test_v3_preset_round_trips_through_its_hf_config():
    transformers = pytest.importorskip("transformers")
    from mini3d.checkpoint.hf_config import config_from_hf, config_to_hf

    cfg = PRESETS["deepseek-v3"]
    d = config_to_hf(cfg)
    assert config_from_hf(d, name="deepseek-v3") == cfg
    hf = transformers.DeepseekV3Config(**d)
    assert (hf.n_routed_experts, hf.first_k_dense_replace, hf.topk_group, hf.q_lora_rank) == (256, 3, 4, 1536)
    assert config_from_hf(hf.to_dict(), name="deepseek-v3") == cfg


def test_tp_counts_split_the_heads_and_replicate_the_latents():
    """layer_param_count(tp): q_b / kv_b / proj divided by tp, q_a / kv_a and the two latent
    norms whole on every rank: what apply_tp builds (the tp2 test trains that layout)."""
    cfg = DENSE
    w = cfg.mla_weights()
    whole = w["q_a"][0] + w["kv_a"][0] + cfg.q_lora_rank + cfg.kv_lora_rank
    split = w["q_b"][0] + w["kv_b"][0] + cfg.n_heads * cfg.v_head_dim * cfg.d_model
    mlp = 3 * cfg.d_model * cfg.d_ff
    for tp in (1, 2):
        assert cfg.layer_param_count(tp) == whole + (split + mlp) // tp + 2 * cfg.d_model


@pytest.mark.timeout(300)
def test_train_init_from_hf_starts_from_the_hf_weights(tmp_path):
    """`train --init-from-hf` of a DeepseekV3 directory over dp=2: the first step's loss is
    transformers' on the same batch (so the routers' correction biases, which change the expert
    choice here, came along with the weights)."""
    from mini3d.cli import main
    from mini3d.data.corpus import Batches, load_tokens

    hf = saved(ds_config(vocab_size=256, max_position_embeddings=128), tmp_path / "hf").eval()
    log = tmp_path / "a.jsonl"
    assert main(["train", "--init-from-hf", str(tmp_path / "hf"), "--log-jsonl", str(log),
                 "--steps", "1", "--seq-len", "32", "--global-batch", "4", "--micro-batches", "1",
                 "--dp", "2", "--no-progress", "--timeout", "250"]) == 0
    x, y = Batches(load_tokens(), 32, 4, 0).global_batch_at(0)  # the batch of step 1 (seed 0)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
        for b in (m.mlp.gate.e_score_correction_bias for m in hf.model.layers[1:]):
            b.zero_()
        unbiased = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    first = json.loads(log.read_text().splitlines()[0])["loss"]
    assert abs(want - unbiased) > 1e-4  # the biases matter to this loss
    assert first == pytest.approx(want, abs=1e-5), (first, want)


def test_flops_count_the_latent_attention():
    """Per token and layer: the matmuls of mla_weights + proj + SwiGLU (2 FLOPs per weight), and
    the attention core over 128 heads of 192-wide q/k and 128-wide v (3.4x a 7168-wide full
    attention's 4 s h): what the model computes, not the d_model-wide rule of the other families."""
    from mini3d.cost.model import flops_per_token

    cfg, s = PRESETS["deepseek-v3"], 4096
    w = sum(n for n, _ in cfg.mla_weights().values()) + 128 * 128 * 7168 + 3 * 7168 * 18432
    f = flops_per_token(cfg, s)
    assert f["attention"] == 2 * s * 128 * (192 + 128)
    assert f["layer"] == 2 * w + f["attention"]


@pytest.mark.timeout(240)
def test_mla_under_cp2_equals_the_reference():
    """Ring attention over cp=2 (zig-zag chunks at their global positions, so the rotary key of
    each chunk is rotated where it belongs; v padded to k's width for the ring's one message),
    float64 against the one-process model with test_3d's F64 bounds."""
    from mini3d.config import Plan
    from mini3d.launch.launcher import launch
    from tests.cp_workers import run_cp_layouts
    from tests.test_3d import F64, F64_BASE, SEED, STEPS, check_float32, reference

    cfg = DENSE
    assert cfg.v_head_dim < cfg.head_dim  # the padded case
    cases = [("cp2", Plan(cp=2, micro_batches=2, **F64_BASE))]
    results = launch(run_cp_layouts, 2, [{"name": n, "plan": dataclasses.asdict(p)} for n, p in cases],
                     dataclasses.asdict(cfg), STEPS, SEED, device="cpu", timeout=200)
    ref = reference(STEPS, cfg=cfg, dtype=torch.float64)
    for name, plan in cases:
        mine = [r for per_rank in results for r in per_rank if r["name"] == name]
        assert mine and all(r["cp_sends"] > 0 for r in mine)
        for r in mine:
            assert r["losses"] == pytest.approx(ref[0], abs=F64["loss"]), name
        check_float32(name, plan, results, ref, cfg=cfg, bounds=F64)


def _papers_sequence_loss(logits: torch.Tensor, chosen: torch.Tensor, B: int, k: int):
    """DeepSeek-V3 eq. 17-20 for one layer, written out token by token (float64): per sequence,
    s' = s / sum_j s_j, P_i = mean_t s'_i,t, f_i = E / (k T) sum_t 1(i chosen at t), loss
    sum_i f_i P_i; the mean over the B sequences."""
    E = logits.shape[-1]
    losses = []
    for s in torch.sigmoid(logits.double()).view(B, -1, E):  # (T, E): one sequence
        T = s.shape[0]
        picked = chosen.view(B, T, k)[len(losses)]
        total = 0.0
        for i in range(E):
            P = sum(s[t, i] / s[t].sum() for t in range(T)) / T
            f = E / (k * T) * sum(float(i in picked[t].tolist()) for t in range(T))
            total = total + f * P
        losses.append(total)
    return sum(losses) / B


@pytest.mark.parametrize("biased", [False, True], ids=["papers-top-k", "biased-grouped-choice"])
def test_sequence_aux_loss_is_the_papers_formula(biased):
    """`sequence_aux_loss` (and seq_aux_loss_coef x it inside the model's loss) against eq. 17-20
    written out, in float64, value and router gradients. Without a bias and with one group the
    chosen experts are the paper's top-k of the scores s (computed here from the logits, not
    by the router); with route groups and expert biases they are the router's choice (the
    reference code's). 2 MoE layers (summed), 3 sequences of 5 tokens (averaged)."""
    from mini3d.models.balance import moe_layers, sequence_aux_loss

    groups = (4, 2) if biased else (1, 1)
    cfg = dataclasses.replace(DS, route_groups=groups[0], route_topk_groups=groups[1],
                              seq_aux_loss_coef=0.003, n_layers=3)
    model = GPT(cfg, seed=2).double()
    layers = moe_layers(model)
    logits = {}
    for m in layers:
        m.router.register_forward_hook(lambda mod, inp, out, m=m: logits.__setitem__(m, out))
        if biased:
            m.expert_bias.copy_(0.3 * torch.randn(cfg.n_experts))
    x = torch.randint(0, cfg.vocab_size, (3, 5), generator=torch.Generator().manual_seed(4))
    with_loss = model(x, x)
    got = sequence_aux_loss(layers)
    want = 0.0
    for m in layers:
        if biased:
            chosen = m.router_kind.route(logits[m], cfg.top_k, m.expert_bias)[1]
        else:
            chosen = torch.topk(torch.sigmoid(logits[m]), cfg.top_k, dim=-1).indices
        want = want + _papers_sequence_loss(logits[m], chosen, 3, cfg.top_k)
    value, expected = float(got.detach()), float(want.detach())
    assert abs(value - expected) < 1e-12 and expected > 0.5
    weights = [m.router.weight for m in layers]
    for g, w in zip(torch.autograd.grad(got, weights, retain_graph=True),
                    torch.autograd.grad(want, weights, retain_graph=True)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-14)
    off = dataclasses.replace(cfg, seq_aux_loss_coef=0.0)
    model.cfg = off
    for m in model.modules():
        if hasattr(m, "cfg") and m.cfg is cfg:
            m.cfg = off
    assert abs(float((with_loss - model(x, x)).detach()) - 0.003 * expected) < 1e-12


@pytest.mark.parametrize("E,G,K,k,ep,most", [
    (8, 2, 1, 3, 2, 1),  # route_groups = ep: one rank a token
    (16, 4, 2, 4, 4, 2),  # route_groups = ep = 4, top 2 groups: two ranks of four
    (16, 8, 2, 4, 4, 2),  # two groups a rank: still at most K ranks
    (16, 2, 1, 3, 4, 2),  # ep a multiple of the groups: a group spans ep / G = 2 ranks
])
def test_node_limited_routing_reaches_at_most_k_ep_ranks(E, G, K, k, ep, most):
    """The router's choice, mapped to ep ranks by ep's own expert slices: with route_groups a
    multiple of ep every token's top-k live on <= route_topk_groups ranks (<= K ep / G when ep
    is a multiple of G; GroupedSigmoidRouter's docstring), under large random biases that
    would pull the choice elsewhere; without the groups the same scores reach more ranks."""
    from mini3d.ep.apply import expert_slice

    rank_of = torch.empty(E, dtype=torch.long)
    for r in range(ep):
        rank_of[expert_slice(E, ep, r)] = r
    g = torch.Generator().manual_seed(E + G + ep)
    logits, bias = torch.randn(4096, E, generator=g), torch.randn(E, generator=g)
    for groups, topk_groups, bound in ((G, K, most), (1, 1, None)):
        experts = GroupedSigmoidRouter(groups, topk_groups, 2.5, True).route(logits, k, bias)[1]
        reached = torch.tensor([len(set(rank_of[t].tolist())) for t in experts])
        if bound is not None:
            assert int(reached.max()) == bound  # at most, and reached
        else:
            assert int(reached.max()) > most  # the limit comes from the groups
