"""The presets: named `ModelConfig`s, the course's small shapes and real models with their
published dimensions (`mini3d.config` re-exports them next to `Plan`)."""

from __future__ import annotations

import dataclasses

from mini3d.models.config import ModelConfig, PlanError

# Presets: `tiny` and `small` train on a laptop CPU in minutes (exact GELU, untied head: the
# course's numbers); `gpt-1.3b` .. `gpt-175b` are GPT-style shapes (the 22B and 175B rows are those
# of Korthikanti et al. 2022, which calibrate the cost model; `gpt-70b` widens the MLP to ~70e9
# parameters: a teaching shape, not a real model, kept because the course's lessons and exercises
# use its full multi-head attention, e.g. tp=16); the rest are real models with their
# published dimensions: GPT-2 (Radford et al. 2019; tanh GELU, tied head) and Llama 3 (Llama 3 Herd
# of Models, 2024, table 3; 128256-token vocabulary, rope base 500000, 8 key/value heads).
# Llama's max_seq_len is 8192, the context of its main pre-training stage (the default sequence
# length of estimates); the 3.1 / 3.2 models rescale their rotary frequencies for 128K contexts.
# Qwen2.5-7B and Qwen3-8B: their model cards' config.json (rope base 1e6, RMSNorm eps 1e-6, untied
# heads; Qwen3's heads are 128 wide); max_seq_len 32768, the context of their last pre-training
# stage (Qwen2.5 and Qwen3 technical reports).
_GPT2 = dict(family="gpt2", activation="gelu_tanh", tie_embeddings=True)
_LLAMA3 = dict(family="llama", n_kv_heads=8, rope_base=500000.0, rope_scaling=(8.0, 1.0, 4.0, 8192))
_QWEN = dict(rope_base=1e6, norm_eps=1e-6)


def _MOE(experts: int, top_k: int, rope_base: float) -> dict:
    return dict(family="llama", n_kv_heads=8, rope_base=rope_base, n_experts=experts, top_k=top_k,
                router="softmax-norm")


_QWEN3_MOE = {**_MOE(128, 8, 1e6), "n_kv_heads": 4, "family": "qwen3", "explicit_head_dim": 128}
# The deepseek family: multi-head latent attention (kv latent 512, heads 128 + 64 rotary wide for
# q/k and 128 for v), DeepSeek's interleaved rotary layout, RMSNorm eps 1e-6.
_DEEPSEEK = dict(family="deepseek", kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128,
                 v_head_dim=128, rope_interleave=True, norm_eps=1e-6)
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(4, 64, 4, 256, 128, name="tiny"),
    "small": ModelConfig(6, 256, 8, 256, 256, name="small"),
    "gpt2-124m": ModelConfig(12, 768, 12, 50257, 1024, name="gpt2-124m", **_GPT2),
    "gpt2-355m": ModelConfig(24, 1024, 16, 50257, 1024, name="gpt2-355m", **_GPT2),
    "gpt2-774m": ModelConfig(36, 1280, 20, 50257, 1024, name="gpt2-774m", **_GPT2),
    "gpt2-1.5b": ModelConfig(48, 1600, 25, 50257, 1024, name="gpt2-1.5b", **_GPT2),
    "gpt-1.3b": ModelConfig(24, 2048, 16, 50257, 2048, name="gpt-1.3b"),
    "gpt-7b": ModelConfig(32, 4096, 32, 32000, 4096, name="gpt-7b"),
    "gpt-22b": ModelConfig(48, 6144, 64, 51200, 2048, name="gpt-22b"),
    "gpt-70b": ModelConfig(80, 8192, 64, 32000, 4096, d_ff=36864, name="gpt-70b"),
    "gpt-175b": ModelConfig(96, 12288, 96, 51200, 2048, name="gpt-175b"),
    "llama-3.2-1b": ModelConfig(16, 2048, 32, 128256, 8192, 8192, name="llama-3.2-1b",
                                tie_embeddings=True, **{**_LLAMA3, "rope_scaling": (32.0, 1.0, 4.0, 8192)}),
    "llama-3.1-8b": ModelConfig(32, 4096, 32, 128256, 8192, 14336, name="llama-3.1-8b", **_LLAMA3),
    "llama-3.1-70b": ModelConfig(80, 8192, 64, 128256, 8192, 28672, name="llama-3.1-70b", **_LLAMA3),
    "llama-3.1-405b": ModelConfig(126, 16384, 128, 128256, 8192, 53248, name="llama-3.1-405b",
                                  **_LLAMA3),
    "qwen2.5-7b": ModelConfig(28, 3584, 28, 152064, 32768, 18944, name="qwen2.5-7b", **_QWEN,
                              family="qwen2", n_kv_heads=4),
    "qwen3-8b": ModelConfig(36, 4096, 32, 151936, 32768, 12288, name="qwen3-8b", **_QWEN,
                            family="qwen3", n_kv_heads=8, explicit_head_dim=128),
    # Mixture-of-experts models with their published config.json shapes (Mixtral of Experts,
    # Jiang et al. 2024; the Qwen3 technical report, 2025): softmax-norm routing (Mixtral's top-k
    # softmax equals the renormalised top-k of the full softmax; Qwen3's norm_topk_prob).
    "mixtral-8x7b": ModelConfig(32, 4096, 32, 32000, 32768, 14336, name="mixtral-8x7b",
                                **_MOE(8, 2, 1e6)),
    "mixtral-8x22b": ModelConfig(56, 6144, 48, 32768, 65536, 16384, name="mixtral-8x22b",
                                 **_MOE(8, 2, 1e6)),
    # Qwen3-MoE: the qwen3 family's attention (q/k RMSNorm, heads 128 wide).
    "qwen3-30b-a3b": ModelConfig(48, 2048, 32, 151936, 40960, 6144, name="qwen3-30b-a3b",
                                 moe_ffn=768, norm_eps=1e-6, **_QWEN3_MOE),
    "qwen3-235b-a22b": ModelConfig(94, 4096, 64, 151936, 40960, 12288, name="qwen3-235b-a22b",
                                   moe_ffn=1536, norm_eps=1e-6, **_QWEN3_MOE),
    # DeepSeek-V3 (DeepSeek-V3 Technical Report, 2024; its config.json): 61 layers, the first 3
    # dense, then 256 routed experts 2048 wide + 1 shared, top 8 within the best 4 of 8 groups,
    # sigmoid scores, renormalised, x 2.5; a 1536-wide query latent. 671B parameters, 37B
    # activated per token, as the model card counts them: WITHOUT the multi-token-prediction
    # (MTP) module (the card's 685B includes its 14B), which mini3d does not build. max_seq_len
    # 4096 is the pre-training context, without YaRN; the released 128K model is this with
    # --yarn 40 4096 32 1 1 1 --max-seq-len 163840 (what importing its config.json gives).
    "deepseek-v3": ModelConfig(61, 7168, 128, 129280, 4096, 18432, name="deepseek-v3",
                               q_lora_rank=1536, n_experts=256, top_k=8, moe_ffn=2048,
                               n_shared_experts=1, dense_layers=3, router="sigmoid",
                               route_groups=8, route_topk_groups=4, routed_scaling_factor=2.5,
                               **_DEEPSEEK),
    # DeepSeek-V2-Lite (DeepSeek-V2 paper, 2024, appendix; its config.json): 15.7B total, 2.4B
    # active; no query latent (one full q projection), the first layer dense, then 64 experts
    # 1408 wide + 2 shared, top 6 of the softmax, not renormalised (V2's routing). The course's
    # laptop-sized deepseek; its 32K context's YaRN left out as for deepseek-v3.
    "deepseek-v2-lite": ModelConfig(27, 2048, 16, 102400, 4096, 10944, name="deepseek-v2-lite",
                                    q_lora_rank=0, n_experts=64, top_k=6, moe_ffn=1408,
                                    n_shared_experts=2, dense_layers=1, router="softmax",
                                    **_DEEPSEEK),
}
# What a preset's counts leave out, for `estimate`'s report (and its --json "notes")
NOTES = {"deepseek-v3": ["the multi-token-prediction (MTP) module is not included (the model "
                         "card's 671B total / 37B active exclude it too; its 685B includes it)"]}
# Old names, kept working: each is the same object as the preset it names.
ALIASES = {"gpt2-small": "gpt2-124m", "gpt2-medium": "gpt2-355m", "gpt2-large": "gpt2-774m",
           "gpt2-xl": "gpt2-1.5b"}
PRESETS.update({old: PRESETS[new] for old, new in ALIASES.items()})


def preset_notes(cfg: ModelConfig) -> list[str]:
    """NOTES of the preset `cfg` was made from (its name, or name+custom), else []."""
    return list(NOTES.get(cfg.name.split("+")[0], []))


def model_from_preset(preset: str, **overrides) -> ModelConfig:
    """A preset, with any ModelConfig fields overridden."""
    if preset not in PRESETS:
        raise PlanError([f"model={preset!r} is not a preset (choose from {', '.join(PRESETS)})"])
    return dataclasses.replace(PRESETS[preset], **overrides) if overrides else PRESETS[preset]


__all__ = ["PRESETS", "ALIASES", "NOTES", "model_from_preset", "preset_notes"]
