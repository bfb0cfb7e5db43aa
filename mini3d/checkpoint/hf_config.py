"""Hugging Face `config.json` <-> `ModelConfig`, for every family mini3d converts:

    model_type   class                 mini3d family   what differs from llama
    gpt2         GPT2LMHeadModel       gpt2            (its own family)
    llama        LlamaForCausalLM      llama
    qwen2        Qwen2ForCausalLM      qwen2           biases on q, k and v
    qwen3        Qwen3ForCausalLM      qwen3           RMSNorm per q / k head, explicit head_dim

Variants mini3d does not implement (sliding-window attention, Llama's or Qwen3's `attention_bias`,
which also biases the output projection, another activation) are refused with `HFError` naming
the field, rather than converted into a model that computes something else.
"""

from __future__ import annotations

from mini3d.config import ModelConfig


class HFError(ValueError):
    """A directory or configuration mini3d cannot convert; the message says what and why."""


# model_type -> (mini3d family, the transformers class that loads it)
LLAMA_LIKE = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
              "qwen3": ("qwen3", "Qwen3ForCausalLM")}
# the one attention variant each llama-like family has: (qkv_bias, qk_norm)
VARIANT = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}


def _gpt2_config(d: dict, name: str) -> ModelConfig:
    act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if d.get("activation_function", "gelu_new") not in act:
        raise HFError(f"activation_function={d['activation_function']!r} is not supported")
    if d.get("scale_attn_by_inverse_layer_idx") or d.get("scale_attn_weights") is False:
        raise HFError("GPT-2 attention scaling variants are not supported")
    h = d["n_embd"]
    return ModelConfig(d["n_layer"], h, d["n_head"], d["vocab_size"], d["n_positions"],
                       d.get("n_inner") or 4 * h, name=name, family="gpt2",
                       tie_embeddings=d.get("tie_word_embeddings", True),
                       norm_eps=d.get("layer_norm_epsilon", 1e-5),
                       activation=act[d.get("activation_function", "gelu_new")])


def _rope(d: dict) -> tuple[float, tuple]:
    """(rope base, Llama 3.1 scaling or ()) of a llama-like config."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise HFError(f"rope type {kind!r} is not supported (mini3d implements the default "
                      f"rotary embedding and Llama 3.1's rescaling, 'llama3')")
    scaling = () if kind == "default" else (
        float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]))
    return float(rope.get("rope_theta", d.get("rope_theta", 10000.0))), scaling


def _refuse_variants(d: dict, kind: str) -> None:
    if d.get("attention_bias") or d.get("mlp_bias") or d.get("hidden_act", "silu") != "silu":
        raise HFError(f"{kind} variants with attention_bias, mlp_bias or another activation than "
                      f"silu are not supported")
    if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or ()):
        raise HFError(f"{kind} with sliding-window attention (use_sliding_window) is not supported")


def llama_like_fields(d: dict, kind: str) -> dict:
    """The ModelConfig fields of a llama-like config.json (model_type `kind`), MoE ones aside."""
    _refuse_variants(d, kind)
    base, scaling = _rope(d)
    h, nh = d["hidden_size"], d["num_attention_heads"]
    hd = d.get("head_dim") or h // nh
    # qwen3 states its head width (128 at every size): kept explicit, so presets round-trip
    explicit = hd if kind.startswith("qwen3") or hd * nh != h else 0
    return dict(n_layers=d["num_hidden_layers"], d_model=h, n_heads=nh, vocab_size=d["vocab_size"],
                max_seq_len=d.get("max_position_embeddings", 2048),
                d_ff=d["intermediate_size"], n_kv_heads=d.get("num_key_value_heads") or nh,
                rope_base=base, rope_scaling=scaling,
                tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                norm_eps=d.get("rms_norm_eps", 1e-6), explicit_head_dim=explicit)


def config_from_hf(d: dict, name: str = "hf") -> ModelConfig:
    """The ModelConfig of an HF `config.json` (one of the classes in the module docstring)."""
    kind = d.get("model_type")
    if kind == "gpt2":
        return _gpt2_config(d, name)
    if kind in LLAMA_LIKE:
        return ModelConfig(name=name, family=LLAMA_LIKE[kind][0], **llama_like_fields(d, kind))
    raise HFError(f"model_type={kind!r} is not supported (mini3d converts gpt2, "
                  f"{', '.join(LLAMA_LIKE)})")


def _gpt2_to_hf(cfg: ModelConfig) -> dict:
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[cfg.activation]
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": cfg.n_layers,
            "n_embd": cfg.d_model, "n_head": cfg.n_heads, "n_positions": cfg.max_seq_len,
            "n_inner": cfg.d_ff, "activation_function": act,
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout, "attn_pdrop": 0.0}


def llama_like_to_hf(cfg: ModelConfig, kind: str, arch: str) -> dict:
    """The llama-like fields of an HF config.json (model_type `kind`, class `arch`)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling:
        factor, low, high, n = cfg.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_base, "factor": factor,
                "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": n}
    return {"architectures": [arch], "model_type": kind,
            "num_hidden_layers": cfg.n_layers, "hidden_size": cfg.d_model,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "intermediate_size": cfg.d_ff,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_base, "rope_parameters": rope,  # (transformers >= 5)
            **({"rope_scaling": dict(rope)} if cfg.rope_scaling else {}),  # (transformers 4)
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "use_sliding_window": False}


def config_to_hf(cfg: ModelConfig) -> dict:
    """An HF `config.json` for `cfg` (written by hand: exporting needs no transformers)."""
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "torch_dtype": "float32", "dtype": "float32"}
    if cfg.family == "gpt2":
        return {**_gpt2_to_hf(cfg), **common}
    if (cfg.qkv_bias, cfg.qk_norm) != VARIANT[cfg.family]:
        raise HFError(f"a {cfg.family} model with qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm} "
                      f"has no Hugging Face class (qwen2 has q/k/v biases, qwen3 q/k norms, "
                      f"llama neither)")
    return {**llama_like_to_hf(cfg, cfg.family, LLAMA_LIKE[cfg.family][1]), **common}


__all__ = ["HFError", "config_from_hf", "config_to_hf", "llama_like_fields", "llama_like_to_hf",
           "LLAMA_LIKE"]
