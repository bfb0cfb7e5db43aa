"""Hugging Face `config.json` <-> `ModelConfig`, for every family mini3d converts:

    model_type   class                 mini3d family   what differs from llama
    gpt2         GPT2LMHeadModel       gpt2            (its own family)
    llama        LlamaForCausalLM      llama
    qwen2        Qwen2ForCausalLM      qwen2           biases on q, k and v
    qwen3        Qwen3ForCausalLM      qwen3           RMSNorm per q / k head, explicit head_dim
    mixtral      MixtralForCausalLM    llama + experts softmax-norm router, experts d_ff wide
    qwen3_moe    Qwen3MoeForCausalLM   qwen3 + experts softmax(-norm) router, moe_intermediate_size
    deepseek_v3  DeepseekV3ForCausalLM deepseek        latent attention (MLA), grouped sigmoid router

A MoE model's routing fields are its config's: experts, top_k, the router (Mixtral renormalises
the top-k weights; Qwen3-MoE when `norm_topk_prob`), and the balancing loss's coefficient only
where transformers adds it to the loss too (`output_router_logits`).

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
    sliding = d.get("use_sliding_window") or (kind == "mixtral" and d.get("sliding_window"))
    if sliding or "sliding_attention" in (d.get("layer_types") or ()):
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


# model_type -> (mini3d family, class, HF field of the expert count, of the expert width)
MOE = {"mixtral": ("llama", "MixtralForCausalLM", "num_local_experts", "intermediate_size"),
       "qwen3_moe": ("qwen3", "Qwen3MoeForCausalLM", "num_experts", "moe_intermediate_size")}


def moe_fields(d: dict, kind: str) -> dict:
    """The MoE fields of a Mixtral / Qwen3-MoE config.json."""
    if d.get("router_jitter_noise"):
        raise HFError(f"router_jitter_noise={d['router_jitter_noise']} is not supported")
    n = d["num_hidden_layers"]
    dense = list(d.get("mlp_only_layers") or [])
    if d.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
        raise HFError(f"decoder_sparse_step={d.get('decoder_sparse_step')}, mlp_only_layers={dense}: "
                      f"mini3d's dense layers are the first dense_layers of every layer")
    norm = kind == "mixtral" or d.get("norm_topk_prob", False)
    coef = float(d.get("router_aux_loss_coef", 0.0)) if d.get("output_router_logits") else 0.0
    experts = d.get(MOE[kind][2]) or d["num_local_experts"]  # (transformers 5 renames Qwen3-MoE's)
    return dict(n_experts=experts, top_k=d["num_experts_per_tok"],
                moe_ffn=0 if kind == "mixtral" else d[MOE[kind][3]],  # Mixtral: d_ff wide
                router="softmax-norm" if norm else "softmax",
                aux_loss_coef=coef, dense_layers=min(len(dense), n))


def moe_to_hf(cfg: ModelConfig) -> dict:
    """A Mixtral (llama family) or Qwen3-MoE (qwen3) config.json of a MoE `cfg`."""
    kind = {"llama": "mixtral", "qwen3": "qwen3_moe"}.get(cfg.family)
    qwen_router = kind == "qwen3_moe" and cfg.router in ("softmax", "softmax-norm")
    mixtral = kind == "mixtral" and cfg.router == "softmax-norm" and not cfg.dense_layers and \
        cfg.moe_width == cfg.d_ff
    if not (mixtral or qwen_router) or cfg.n_shared_experts or cfg.moe_every != 1 or \
            cfg.capacity_factor or cfg.qkv_bias or (cfg.qk_norm != (kind == "qwen3_moe")):
        raise HFError(f"this MoE model (family={cfg.family}, router={cfg.router}, shared experts="
                      f"{cfg.n_shared_experts}, moe_every={cfg.moe_every}, capacity_factor="
                      f"{cfg.capacity_factor}, moe_ffn={cfg.moe_width}, d_ff={cfg.d_ff}) has no Hugging "
                      f"Face class (Mixtral: llama, softmax-norm, experts d_ff wide; Qwen3-MoE: qwen3, "
                      f"softmax or softmax-norm; neither has shared experts or a capacity)")
    family, arch, count, width = MOE[kind]
    out = {**llama_like_to_hf(cfg, kind, arch), count: cfg.n_experts, width: cfg.moe_width,
           "num_local_experts": cfg.n_experts,
           "num_experts_per_tok": cfg.top_k, "output_router_logits": bool(cfg.aux_loss_coef),
           "router_aux_loss_coef": cfg.aux_loss_coef or 0.001, "router_jitter_noise": 0.0}
    if kind == "qwen3_moe":
        out.update(norm_topk_prob=cfg.router == "softmax-norm", decoder_sparse_step=1,
                   intermediate_size=cfg.d_ff, mlp_only_layers=list(range(cfg.dense_layers)))
    else:
        out["sliding_window"] = None
    return out


DEEPSEEK = ("deepseek_v3", "DeepseekV3ForCausalLM")


def deepseek_fields(d: dict) -> dict:
    """The ModelConfig fields of a DeepseekV3 config.json: MLA's widths, its rotary layout, and
    the MoE (every layer from first_k_dense_replace on; sigmoid scores with the correction bias,
    grouped, scaled, renormalised as norm_topk_prob says), and YaRN as DeepSeek-V3's own config
    has it (factor 40 over 4096 positions, for its 128K context). Other rope types, and YaRN with
    an explicit attention_factor or truncate=false, are refused."""
    if d.get("attention_bias") or d.get("hidden_act", "silu") != "silu":
        raise HFError("deepseek_v3 variants with attention_bias or another activation than silu "
                      "are not supported")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn") or (kind == "yarn" and (
            rope.get("attention_factor") is not None or rope.get("truncate", True) is False)):
        raise HFError(f"rope_scaling / rope_parameters of type {kind!r} (attention_factor="
                      f"{rope.get('attention_factor')}, truncate={rope.get('truncate', True)}): "
                      f"mini3d's deepseek family implements the default rotary embedding and YaRN "
                      f"with its attention factor from mscale / mscale_all_dim, truncated")
    yarn = () if kind == "default" else (
        float(rope["factor"]), int(rope["original_max_position_embeddings"]),
        float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
        float(rope.get("mscale") or 0), float(rope.get("mscale_all_dim") or 0))
    n, experts = d["num_hidden_layers"], d.get("n_routed_experts") or 0
    out = dict(n_layers=n, d_model=d["hidden_size"], n_heads=d["num_attention_heads"],
               vocab_size=d["vocab_size"], max_seq_len=d.get("max_position_embeddings", 2048),
               d_ff=d["intermediate_size"], rope_base=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
               tie_embeddings=bool(d.get("tie_word_embeddings", False)),
               norm_eps=d.get("rms_norm_eps", 1e-6), q_lora_rank=d.get("q_lora_rank") or 0,
               kv_lora_rank=d["kv_lora_rank"], qk_rope_dim=d["qk_rope_head_dim"],
               qk_nope_dim=d["qk_nope_head_dim"], v_head_dim=d["v_head_dim"],
               rope_interleave=bool(d.get("rope_interleave", True)), yarn=yarn)
    dense = min(d.get("first_k_dense_replace") or 0, n)
    if not experts or dense == n:
        return out
    return {**out, "n_experts": experts, "top_k": d["num_experts_per_tok"],
            "moe_ffn": d["moe_intermediate_size"], "n_shared_experts": d.get("n_shared_experts") or 0,
            "dense_layers": dense, "router": "sigmoid", "route_groups": d.get("n_group") or 1,
            "route_topk_groups": d.get("topk_group") or 1,
            "routed_scaling_factor": float(d.get("routed_scaling_factor", 1.0)),
            "norm_topk_prob": bool(d.get("norm_topk_prob", True))}


def deepseek_to_hf(cfg: ModelConfig) -> dict:
    """A DeepseekV3 config.json of a deepseek `cfg` (a dense one: every layer first_k_dense)."""
    if cfg.n_experts and (cfg.router != "sigmoid" or not cfg.n_shared_experts or cfg.moe_every != 1
                          or cfg.capacity_factor):
        raise HFError(f"this deepseek model (router={cfg.router}, shared experts={cfg.n_shared_experts}, "
                      f"moe_every={cfg.moe_every}, capacity_factor={cfg.capacity_factor}) has no Hugging "
                      f"Face class (DeepseekV3: the sigmoid router, shared experts, every layer from "
                      f"dense_layers on, dropless)")
    moe = cfg.n_experts > 0
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.yarn:
        factor, context, fast, slow, mscale, mscale_all = cfg.yarn
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_base, "factor": factor,
                "original_max_position_embeddings": int(context), "beta_fast": fast,
                "beta_slow": slow, "mscale": mscale, "mscale_all_dim": mscale_all}
    return {"architectures": [DEEPSEEK[1]], "model_type": DEEPSEEK[0],
            "num_hidden_layers": cfg.n_layers, "hidden_size": cfg.d_model,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
            "intermediate_size": cfg.d_ff, "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
            "rope_parameters": rope, "rope_interleave": cfg.rope_interleave, "hidden_act": "silu", "attention_bias": False,
            "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_rope_head_dim": cfg.qk_rope_dim, "qk_nope_head_dim": cfg.qk_nope_dim,
            "v_head_dim": cfg.v_head_dim, "n_routed_experts": cfg.n_experts if moe else 1,
            "num_experts_per_tok": cfg.top_k if moe else 1,
            "moe_intermediate_size": cfg.moe_width if moe else cfg.d_ff,
            "n_shared_experts": cfg.n_shared_experts if moe else 1,
            "first_k_dense_replace": cfg.dense_layers if moe else cfg.n_layers,
            "n_group": cfg.route_groups, "topk_group": cfg.route_topk_groups,
            "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
            "num_nextn_predict_layers": 0}


def config_from_hf(d: dict, name: str = "hf") -> ModelConfig:
    """The ModelConfig of an HF `config.json` (one of the classes in the module docstring)."""
    kind = d.get("model_type")
    if kind == "gpt2":
        return _gpt2_config(d, name)
    if kind in LLAMA_LIKE:
        return ModelConfig(name=name, family=LLAMA_LIKE[kind][0], **llama_like_fields(d, kind))
    if kind in MOE:
        return ModelConfig(name=name, family=MOE[kind][0], **llama_like_fields(d, kind),
                           **moe_fields(d, kind))
    if kind == DEEPSEEK[0]:
        return ModelConfig(name=name, family="deepseek", **deepseek_fields(d))
    raise HFError(f"model_type={kind!r} is not supported (mini3d converts gpt2, "
                  f"{', '.join(LLAMA_LIKE)}, {', '.join(MOE)}, {DEEPSEEK[0]})")


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
    if cfg.family == "gpt2" and not cfg.n_experts:
        return {**_gpt2_to_hf(cfg), **common}
    if cfg.mla:
        return {**deepseek_to_hf(cfg), **common}
    if cfg.n_experts:
        return {**moe_to_hf(cfg), **common}
    if (cfg.qkv_bias, cfg.qk_norm) != VARIANT[cfg.family]:
        raise HFError(f"a {cfg.family} model with qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm} "
                      f"has no Hugging Face class (qwen2 has q/k/v biases, qwen3 q/k norms, "
                      f"llama neither)")
    return {**llama_like_to_hf(cfg, cfg.family, LLAMA_LIKE[cfg.family][1]), **common}


__all__ = ["HFError", "config_from_hf", "config_to_hf", "llama_like_fields", "llama_like_to_hf",
           "moe_fields", "moe_to_hf", "deepseek_fields", "deepseek_to_hf", "LLAMA_LIKE", "MOE", "DEEPSEEK"]
