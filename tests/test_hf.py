"""Outside references: mini3d's GPT-2 and Llama equal transformers' GPT2LMHeadModel and
LlamaForCausalLM on the same weights (loaded through mini3d's importer), and checkpoints go to and
from Hugging Face directories exactly. Tiny random configs built here; nothing is downloaded."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mini3d.cli import main  # noqa: E402
from mini3d.checkpoint.hf import read_hf_dir, to_hf_state  # noqa: E402
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


CONFIGS = {
    "gpt2": lambda: gpt2_config(),
    "llama-gqa-untied": lambda: llama_config(),
    "llama-tied": lambda: llama_config(num_key_value_heads=4, tie_word_embeddings=True),
    # Llama 3.1's rescaled rotary frequencies, with a context short enough that every band of
    # the tiny head (slowed, interpolated, kept) shows within 12 positions
    "llama3-rope": lambda: llama_config(rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}
MODELS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


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
    return to_hf_state({n: p.grad for n, p in mini.named_parameters()}, cfg)


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
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (hf, mini)]
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
        for opt in opts:
            opt.step()
            opt.zero_grad()


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
                 "llama-3.1-405b"):
        cfg = PRESETS[name]
        d = config_to_hf(cfg)
        assert config_from_hf(d, name=name) == cfg, name
        kind = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig}[d["model_type"]]
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
