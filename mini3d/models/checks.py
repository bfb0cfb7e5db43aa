"""The checks of a model's shape (`ModelConfig.problems`): every value that cannot build a model,
named with what would fit: the common dimensions and families, multi-head latent attention
(deepseek), the mixture of experts and DeepSeek-V3's grouped routing."""

from __future__ import annotations

import math

from mini3d.models.families import ACTIVATIONS, AUX_LOSS_SCOPES, FAMILIES, ROUTERS, divisors


def model_problems(cfg) -> list[str]:
    """Every reason the shape `cfg` (a ModelConfig) cannot be built."""
    out = []
    for name in ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len", "d_ff", "n_kv_heads"):
        if getattr(cfg, name) < 1:
            out.append(f"{name}={getattr(cfg, name)} must be >= 1")
    if cfg.explicit_head_dim < 0:
        out.append(f"explicit_head_dim={cfg.explicit_head_dim} must be >= 0 (0: d_model / n_heads)")
    if cfg.n_heads >= 1 and cfg.d_model % cfg.n_heads and not (cfg.explicit_head_dim or cfg.mla):
        out.append(f"n_heads={cfg.n_heads} does not divide d_model={cfg.d_model} "
                   f"(choose n_heads in {divisors(cfg.d_model)[:12]})")
    if cfg.n_kv_heads >= 1 and cfg.n_heads % cfg.n_kv_heads:
        out.append(f"n_kv_heads={cfg.n_kv_heads} does not divide n_heads={cfg.n_heads} "
                   f"(choose n_kv_heads in {divisors(cfg.n_heads)})")
    if cfg.family not in FAMILIES:
        out.append(f"family={cfg.family!r} is unknown (choose {', '.join(FAMILIES)})")
    else:
        if cfg.activation not in ACTIVATIONS[cfg.family]:
            out.append(f"activation={cfg.activation!r} is not one of the {cfg.family} family "
                       f"(choose {', '.join(ACTIVATIONS[cfg.family])})")
        if cfg.family == "gpt2" and cfg.n_kv_heads != cfg.n_heads:
            out.append(f"n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads}: grouped-query "
                       f"attention is a llama-family feature (use --family llama)")
        if cfg.llama_like and not cfg.mla and cfg.n_heads >= 1 and cfg.head_dim % 2:
            out.append(f"head_dim={cfg.head_dim} must be even for rotary positions")
        if cfg.family == "gpt2" and (cfg.qk_norm or cfg.explicit_head_dim):
            out.append(f"qk_norm={cfg.qk_norm}, explicit_head_dim={cfg.explicit_head_dim}: "
                       f"q/k norms and a head width of its own are llama-like features "
                       f"(use --family qwen3 or llama)")
    out += _mla_problems(cfg)
    if cfg.rope_scaling and (len(cfg.rope_scaling) != 4 or not cfg.llama_like) and not cfg.mla:
        out.append(f"rope_scaling={cfg.rope_scaling} must be (factor, low_freq_factor, "
                   f"high_freq_factor, original context) of a llama-family model")
    if not 0.0 <= cfg.dropout < 1.0:
        out.append(f"dropout={cfg.dropout} must be in [0, 1)")
    for name in ("rope_base", "norm_eps"):  # nan passes every comparison below: name it here
        if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) > 0):
            out.append(f"{name}={getattr(cfg, name)} must be a finite number > 0")
    return out + _moe_problems(cfg)

def _mla_problems(cfg) -> list[str]:
    """The deepseek family's latent attention: its widths, and what it does not combine with."""
    if not cfg.mla:
        return [f"{k}={getattr(cfg, k)} is the deepseek family's rotary {what} (got family="
                f"{cfg.family!r}; use --family deepseek)" for k, what in
                (("rope_interleave", "layout"), ("yarn", "rescaling")) if getattr(cfg, k)]
    out = [f"{k}={getattr(cfg, k)} must be >= {lo}" for k, lo in
           (("q_lora_rank", 0), ("kv_lora_rank", 1), ("qk_rope_dim", 2), ("qk_nope_dim", 0),
            ("v_head_dim", 1)) if getattr(cfg, k) < lo]
    if cfg.qk_rope_dim % 2:
        out.append(f"qk_rope_dim={cfg.qk_rope_dim} must be even for rotary positions")
    if cfg.n_kv_heads != cfg.n_heads:
        out.append(f"n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads}: the deepseek family's "
                   f"keys and values come from one latent, expanded to every head (leave --kv-heads out)")
    if cfg.explicit_head_dim or cfg.qk_norm or cfg.qkv_bias:
        out.append(f"explicit_head_dim={cfg.explicit_head_dim}, qk_norm={cfg.qk_norm}, "
                   f"qkv_bias={cfg.qkv_bias}: the deepseek family's head widths are qk_nope_dim, "
                   f"qk_rope_dim and v_head_dim, without q/k norms or biases")
    if cfg.rope_scaling:
        out.append(f"rope_scaling={cfg.rope_scaling} is Llama 3.1's rescaling; the deepseek "
                   f"family's is YaRN (--yarn FACTOR CONTEXT BETA_FAST BETA_SLOW "
                   f"MSCALE MSCALE_ALL_DIM)")
    if cfg.yarn and (len(cfg.yarn) != 6 or not all(math.isfinite(v) and v >= 0 for v in cfg.yarn)
                      or cfg.yarn[0] < 1 or cfg.yarn[1] < 1):
        out.append(f"yarn={cfg.yarn} must be (factor >= 1, original context >= 1, beta_fast, "
                   f"beta_slow, mscale, mscale_all_dim), all finite and >= 0")
    return out

def _moe_problems(cfg) -> list[str]:
    if cfg.n_experts == 0:
        return []
    out = [f"{k}={getattr(cfg, k)} must be >= {lo}" for k, lo in
           (("n_experts", 1), ("top_k", 1), ("moe_ffn", 0), ("n_shared_experts", 0),
            ("moe_every", 1), ("dense_layers", 0), ("aux_loss_coef", 0), ("z_loss_coef", 0),
            ("seq_aux_loss_coef", 0),
            ("capacity_factor", 0), ("router_bias_rate", 0)) if getattr(cfg, k) < lo]
    if cfg.top_k > cfg.n_experts:
        out.append(f"top_k={cfg.top_k} exceeds n_experts={cfg.n_experts}")
    if cfg.router not in ROUTERS:
        out.append(f"router={cfg.router!r} is unknown (choose {', '.join(ROUTERS)})")
    if cfg.aux_loss_scope not in AUX_LOSS_SCOPES:
        out.append(f"aux_loss_scope={cfg.aux_loss_scope!r} is unknown (choose "
                   f"{', '.join(AUX_LOSS_SCOPES)})")
    if cfg.router_bias_rate and cfg.router != "sigmoid":
        out.append(f"router_bias_rate={cfg.router_bias_rate} needs router='sigmoid' "
                   f"(got {cfg.router!r})")
    return out + _grouped_routing_problems(cfg)

def _grouped_routing_problems(cfg) -> list[str]:
    """DeepSeek-V3's options of the sigmoid router: groups, scaling factor, renormalisation."""
    G, K, E = cfg.route_groups, cfg.route_topk_groups, cfg.n_experts
    options = [f"{k}={getattr(cfg, k)}" for k, off in
               (("route_groups", 1), ("routed_scaling_factor", 1.0), ("norm_topk_prob", True))
               if getattr(cfg, k) != off]
    if options and cfg.router != "sigmoid":
        return [f"{', '.join(options)} need router='sigmoid' (got {cfg.router!r}): they are "
                f"DeepSeek-V3's sigmoid routing options"]
    if not (math.isfinite(cfg.routed_scaling_factor) and cfg.routed_scaling_factor > 0):
        return [f"routed_scaling_factor={cfg.routed_scaling_factor} must be a finite number > 0"]
    if G < 1 or E % G:
        return [f"route_groups={G} must divide n_experts={E} (choose in {divisors(E)})"]
    if G == 1:
        return [] if K == 1 else [f"route_topk_groups={K} needs route_groups > 1"]
    out = []
    if E // G < 2:
        out.append(f"route_groups={G} leaves {E // G} expert per group; a group's score is "
                   f"the sum of its two best (choose route_groups in "
                   f"{[g for g in divisors(E) if E // g >= 2]})")
    if not 1 <= K <= G:
        out.append(f"route_topk_groups={K} must be in 1..route_groups={G}")
    elif cfg.top_k > K * (E // G):
        out.append(f"top_k={cfg.top_k} exceeds the {K * (E // G)} experts of "
                   f"route_topk_groups={K} groups of {E // G}")
    return out
