"""Outside references: mini3d's GPT-2, Llama, Qwen2 and Qwen3 equal transformers' GPT2LMHeadModel,
LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM on the same weights (loaded through
mini3d's importer), `mini3d sample` greedy-decodes what `generate` does, and checkpoints go to and
from Hugging Face directories exactly. Tiny random configs built here; nothing is downloaded."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mini3d.cli import main  # noqa: E402
from mini3d.checkpoint.hf import from_hf_state, read_hf_dir, to_hf_state  # noqa: E402
from mini3d.models.transformer import GPT  # noqa: E402

V, T = 97, 12


def gpt2_config(**kw):
    return transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)


def llama_config(**kw):
    kw = {"num_key_value_heads": 2, "tie_word_embeddings": False, **kw}
    return transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=80,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    max_position_embeddings=64, rms_norm_eps=1e-5,
                                    rope_theta=5e5, **kw)


def qwen_config(kind, **kw):
    """Qwen2 (q/k/v biases) or Qwen3 (q/k norms; heads 12 wide, so q is 48 != hidden 32)."""
    kw = {"num_key_value_heads": 2, "tie_word_embeddings": False, "vocab_size": V,
          "max_position_embeddings": 64, **kw}
    if kind == "qwen3":
        kw.setdefault("head_dim", 12)
    return getattr(transformers, f"{kind.capitalize()}Config")(
        hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        rms_norm_eps=1e-6, rope_theta=1e6, **kw)


def moe_config(kind, **kw):
    """Mixtral (4 experts of d_ff, top 2, renormalised) or Qwen3-MoE (4 experts 24 wide, heads 12
    wide, q/k norms; renormalised unless norm_topk_prob=False)."""
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  num_experts_per_tok=2, rope_theta=1e6, tie_word_embeddings=False)
    if kind == "mixtral":
        return transformers.MixtralConfig(**{**common, "num_local_experts": 4, **kw})
    return transformers.Qwen3MoeConfig(**{**common, "num_experts": 4, "moe_intermediate_size": 24,
                                          "head_dim": 12, "norm_topk_prob": True, **kw})


CONFIGS = {
    "gpt2": lambda: gpt2_config(),
    "llama-gqa-untied": lambda: llama_config(),
    "llama-tied": lambda: llama_config(num_key_value_heads=4, tie_word_embeddings=True),
    # Llama 3.1's rescaled rotary frequencies, with a context short enough that every band of
    # the tiny head (slowed, interpolated, kept) shows within 12 positions
    "llama3-rope": lambda: llama_config(rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2-gqa": lambda: qwen_config("qwen2"),
    "qwen2-tied": lambda: qwen_config("qwen2", num_key_value_heads=4, tie_word_embeddings=True),
    "qwen3-gqa-head-dim-12": lambda: qwen_config("qwen3"),
    "qwen3-tied-head-dim-8": lambda: qwen_config("qwen3", head_dim=8, tie_word_embeddings=True),
    "mixtral": lambda: moe_config("mixtral"),
    "qwen3-moe": lambda: moe_config("qwen3_moe"),
    "qwen3-moe-softmax-dense-first": lambda: moe_config("qwen3_moe", norm_topk_prob=False,
                                                        mlp_only_layers=[0]),
}
MODELS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
          "qwen3_moe": "Qwen3MoeForCausalLM"}


def hf_model(hf_cfg, seed=0):
    torch.manual_seed(seed)
    hf_cfg._attn_implementation = "eager"
    model = getattr(transformers, MODELS[hf_cfg.model_type])(hf_cfg).float()
    with torch.no_grad():  # random biases / norm weights too, so that every mapping matters
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def saved(hf_cfg, path, **save_kw):
    model = hf_model(hf_cfg)
    model.save_pretrained(path, safe_serialization=True, **save_kw)
    return model


def mini3d_model(path) -> GPT:
    cfg, weights = read_hf_dir(str(path))
    model = GPT(cfg, init=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model


def hf_grads(model, cfg, mini) -> dict:
    """mini3d's gradients under HF names (the tied head's gradient is the embedding's)."""
    return to_hf_state({n: p.grad for n, p in mini.named_parameters()}, cfg, layout="fused")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_gradients_equal_transformers(name, tmp_path):
    hf = saved(CONFIGS[name](), tmp_path)
    mini = mini3d_model(tmp_path)
    x = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))
    # float32, same weights: only summation order differs (measured max |diff| <= 1e-7). The bound
    # is tighter than the issue's 1e-5 because exact-erf GELU instead of GPT-2's tanh form is
    # only 9e-6 off here, and must fail
    assert (mini(x) - hf(x).logits).abs().max() < 1e-6
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    for step in range(2):  # the first step's gradients, then after one AdamW update
        ref = hf(x, labels=x).loss  # HF shifts the labels inside
        loss = mini(x[:, :-1], x[:, 1:])
        assert abs(loss.item() - ref.item()) < 1e-5, (step, loss.item(), ref.item())
        ref.backward()
        loss.backward()
        want = {n: p.grad for n, p in hf.named_parameters()}
        got = hf_grads(hf, mini.cfg, mini)
        assert set(got) <= set(want)
        for n, g in got.items():
            err = float((g - want[n]).abs().max() / (want[n].abs().max() + 1e-12))
            assert err < 1e-4, (step, n, err)  # relative to the tensor's largest entry
        # the second point is HF's updated weights, copied into mini3d: AdamW's first step is
        # about lr * sign(g), so an entry whose gradient is at rounding level (1e-9) would move
        # by +lr in one model and -lr in the other (measured: 1e-4 relative gradient differences
        # at step 1 for qwen3, 1e-6 at step 0)
        opt.step()
        opt.zero_grad()
        mini.zero_grad()
        with torch.no_grad():
            for n, p in mini.named_parameters():
                p.copy_(from_hf_state(hf.state_dict(), mini.cfg)[n])  # (MoE: the fused layout)


@pytest.mark.timeout(120)
def test_sharded_import_export_and_from_pretrained_round_trip(tmp_path):
    """import-hf of a sharded llama checkpoint -> export-hf -> from_pretrained: every tensor bit-equal."""
    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    hf = saved(llama_config(), src, max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").exists()
    assert len(set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    assert main(["import-hf", str(src), str(ckpt)]) == 0
    assert (ckpt / "latest").read_text().strip() == "step-000000"
    assert main(["export-hf", str(ckpt), str(out)]) == 0
    back = transformers.LlamaForCausalLM.from_pretrained(str(out))
    want, got = hf.state_dict(), back.state_dict()
    assert sorted(want) == sorted(got)
    for n in want:
        assert torch.equal(want[n], got[n]), n


@pytest.mark.timeout(120)
def test_gpt2_tied_round_trip(tmp_path):
    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    hf = saved(gpt2_config(), src)
    assert main(["import-hf", str(src), str(ckpt)]) == 0
    assert main(["export-hf", str(ckpt), str(out)]) == 0
    back = transformers.GPT2LMHeadModel.from_pretrained(str(out), attn_implementation="eager")
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()  # still tied
    want, got = hf.state_dict(), back.state_dict()
    assert sorted(want) == sorted(got) and all(torch.equal(want[n], got[n]) for n in want)
    x = torch.randint(0, V, (2, T))
    assert torch.equal(hf(x).logits, back(x).logits)


def test_bad_directories_exit_2(tmp_path, capsys):
    assert main(["import-hf", str(tmp_path / "nothing"), str(tmp_path / "ckpt")]) == 2
    assert "config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert main(["import-hf", str(tmp_path), str(tmp_path / "ckpt")]) == 2
    assert "model_type='bert' is not supported" in capsys.readouterr().err
    assert main(["export-hf", str(tmp_path / "none"), str(tmp_path / "out")]) == 2


def test_every_real_preset_survives_the_config_round_trip():
    """config.json of each real preset reads back to the same ModelConfig, and transformers reads
    it as the same shape (no weights built)."""
    import dataclasses

    from mini3d.config import PRESETS
    from mini3d.checkpoint.hf import config_from_hf, config_to_hf

    for name in ("gpt2-124m", "gpt2-1.5b", "llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b",
                 "llama-3.1-405b", "qwen2.5-7b", "qwen3-8b"):
        cfg = PRESETS[name]
        d = config_to_hf(cfg)
        assert config_from_hf(d, name=name) == cfg, name
        kind = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig,
                "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[d["model_type"]]
        hf_cfg = kind(**d)
        back = config_from_hf(hf_cfg.to_dict(), name=name)
        assert dataclasses.asdict(back) == dataclasses.asdict(cfg), name


@pytest.mark.timeout(60)
def test_untied_gpt2_exports_its_own_head(tmp_path):
    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    hf = saved(gpt2_config(tie_word_embeddings=False), src)
    assert main(["import-hf", str(src), str(ckpt)]) == 0 and main(["export-hf", str(ckpt), str(out)]) == 0
    back = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    assert not torch.equal(back.lm_head.weight, back.transformer.wte.weight)
    assert torch.equal(back.lm_head.weight, hf.lm_head.weight)


ROUND_TRIPS = {"qwen2": lambda: qwen_config("qwen2", vocab_size=256),
               "qwen3": lambda: qwen_config("qwen3", vocab_size=256),
               "mixtral": lambda: moe_config("mixtral", vocab_size=256),
               "qwen3_moe": lambda: moe_config("qwen3_moe", vocab_size=256)}


def greedy_sample_matches(hf, ckpt, capsys, prompt="Qwen", n=24):
    """`mini3d sample CKPT --top-k 1` prints the prompt and the n tokens `generate` picks greedily
    (byte tokenizer: the models have 256 ids). Returns the generated ids."""
    ids = list(prompt.encode())
    want = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)[0].tolist()
    assert len(want) == len(ids) + n
    capsys.readouterr()
    assert main(["sample", str(ckpt), "--prompt", prompt, "--top-k", "1",
                 "--max-new-tokens", str(n)]) == 0
    assert capsys.readouterr().out == bytes(want).decode("utf-8", errors="replace") + "\n"
    return want[len(ids):]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(ROUND_TRIPS))
def test_import_samples_what_transformers_generates_and_exports_back(kind, tmp_path, capsys):
    """import-hf -> `mini3d sample` greedy equals `generate`; export-hf -> the same class loads it
    with every tensor bit-equal and the same logits. (MoE: save_pretrained writes one tensor per
    expert, the original repositories' layout; so does export-hf.)"""
    src, ckpt, out = tmp_path / "src", tmp_path / "ckpt", tmp_path / "out"
    hf = saved(ROUND_TRIPS[kind](), src).eval()
    round_trip_matches(hf, src, ckpt, out, getattr(transformers, MODELS[kind]), capsys)


def round_trip_matches(hf, src, ckpt, out, hf_class, capsys, vocab: int = 256):
    """import-hf `src` -> greedy `mini3d sample` equals `generate`; export-hf -> `hf_class` loads
    it with every tensor bit-equal and the same logits as `hf`."""
    assert main(["import-hf", str(src), str(ckpt)]) == 0
    new = greedy_sample_matches(hf, ckpt, capsys)
    assert len(set(new)) > 3  # not one token repeated: the comparison has something to miss
    assert main(["export-hf", str(ckpt), str(out)]) == 0
    back = hf_class.from_pretrained(str(out), attn_implementation="eager")
    assert type(back) is type(hf)
    want, got = hf.state_dict(), back.state_dict()
    assert sorted(want) == sorted(got)
    for n in want:
        assert torch.equal(want[n], got[n]), n
    x = torch.randint(0, vocab, (2, T))
    assert torch.equal(hf(x).logits, back(x).logits)


def test_hf_variants_mini3d_does_not_implement_are_refused():
    """Sliding windows, an output-projection bias, and a mini3d model no HF class holds: HFError
    naming the field, not a model that computes something else."""
    from mini3d.checkpoint.hf import HFError, config_from_hf, config_to_hf
    from mini3d.config import ModelConfig

    for kind, field in (("qwen2", "use_sliding_window"), ("qwen3", "attention_bias"),
                        ("llama", "attention_bias")):
        d = qwen_config(kind).to_dict() if kind != "llama" else llama_config().to_dict()
        d[field] = True
        with pytest.raises(HFError, match=field):
            config_from_hf(d)
    with pytest.raises(HFError, match="qkv_bias=True, qk_norm=False has no Hugging Face class"):
        config_to_hf(ModelConfig(family="llama", qkv_bias=True))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_reads_the_fused_expert_layout_too(kind, tmp_path):
    """A directory holding transformers 5's fused expert tensors (the modules' own state dict)
    imports to the same weights as the per-expert one save_pretrained writes; the names differ."""
    import dataclasses

    from safetensors import safe_open
    from safetensors.torch import save_file

    per, fused = tmp_path / "per", tmp_path / "fused"
    hf = saved(moe_config(kind), per)
    with safe_open(str(per / "model.safetensors"), "pt") as f:
        assert any(".experts.3." in k for k in f.keys())  # one tensor per expert on disk
    fused.mkdir()
    (fused / "config.json").write_text((per / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    (cfg_a, a), (cfg_b, b) = read_hf_dir(str(per)), read_hf_dir(str(fused))
    assert cfg_a.n_experts == 4 and cfg_a == dataclasses.replace(cfg_b, name=cfg_a.name)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert a["blocks.1.mlp.experts.w_gate"].shape == (4, cfg_a.moe_width, 32)
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]  # gate rows first, then up
    assert torch.equal(a["blocks.1.mlp.experts.w_up"], gate_up[:, cfg_a.moe_width:])


def test_moe_configs_round_trip_and_refuse_what_hf_cannot_hold():
    import dataclasses

    from mini3d.checkpoint.hf import HFError, config_from_hf, config_to_hf
    from mini3d.config import PRESETS

    for name in ("mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b"):
        cfg = PRESETS[name]
        d = config_to_hf(cfg)
        assert config_from_hf(d, name=name) == cfg, name
        kind = {"mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig}
        back = config_from_hf(kind[d["model_type"]](**d).to_dict(), name=name)
        assert back == cfg, name
    for change in (dict(n_shared_experts=1), dict(router="sigmoid"), dict(capacity_factor=1.0)):
        with pytest.raises(HFError, match="has no Hugging"):
            config_to_hf(dataclasses.replace(PRESETS["mixtral-8x7b"], **change))
    with pytest.raises(HFError, match="decoder_sparse_step"):
        config_from_hf({**moe_config("qwen3_moe").to_dict(), "decoder_sparse_step": 2})
