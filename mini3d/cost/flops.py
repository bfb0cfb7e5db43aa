"""FLOPs of a GPT step (one owner: the time model, MFU, the planner and the course call these).

FLOPs (per token, forward; Megatron's convention, so MFU compares with published numbers):

    layer  = 2 * (3h^2 + h^2 + 2hf)   qkv, attention projection, MLP fc and proj matmuls
           + 4sh                      QK^T and attention-times-V over the full s x s square
             (llama: qkv is h(h + 2kv) with kv = n_kv_heads * head_dim, the MLP 3hf; the
             weights of `ModelConfig.layer_weights`)
    head   = 2hV                      output projection (embedding lookups cost no FLOPs)
    MoE layer: the MLP's 2hf becomes 2 x (the router's E x h + top_k experts + the shared
             experts), the parameters one token computes with (`ModelConfig.moe_params(active=
             True)`): MFU counts active parameters, as Megatron-Core and torchtitan do for MoE.
             Dropped slots (a capacity factor) still count: the FLOPs are the nominal ones.

The attention term counts the whole s x s square, causal masking or not (`FLOPS_CONVENTION`): the
convention of Narayanan et al. 2021 (eq. 3) and of torchtitan's MFU. Tables that halve it for
causal attention (some of NVIDIA's NeMo performance tables do) report a lower MFU for the same
step time; compare like with like.

Norm, GELU / SiLU, rotary, softmax and bias FLOPs are left out (well under 1% for these shapes). Model FLOPs
are 3 * (L*layer + head) per token (backward = 2 x forward); hardware FLOPs add what recompute runs
again: the whole layer forward under full recompute, the 4sh attention core under selective.
"""

from __future__ import annotations

from mini3d.config import ModelConfig, Plan

FLOPS_CONVENTION = ("full attention square (not causal-halved), Megatron-LM's and torchtitan's; "
                    "MoE layers: active parameters (router, top_k routed and the shared experts)")


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict:
    """Forward FLOPs per token: one dense layer's matmuls + attention ("layer"), its attention
    core, the head, and for a MoE model one MoE layer's ("moe_layer": attention, router, top_k
    experts, shared experts) and all the layers together ("layers")."""
    h = cfg.d_model
    attn = 4 * seq_len * h
    if cfg.mla:  # scores over n_heads (nope + rope)-wide heads, the sum over v_head_dim-wide ones
        attn = 2 * seq_len * cfg.n_heads * (cfg.head_dim + cfg.v_head_dim)
    w = cfg.layer_weights()  # GQA's narrower K/V; SwiGLU's three matrices
    out = {"layer": 2 * sum(w.values()) + attn, "attention": attn, "head": 2 * h * cfg.vocab_size}
    if cfg.n_experts:
        active = sum(cfg.moe_params(1, active=True).values())  # router + top_k experts + shared
        out["moe_layer"] = 2 * (w["qkv"] + w["proj"] + active) + attn
    out["layers"] = layers_flops(cfg, seq_len, range(cfg.n_layers), out)
    return out


def layers_flops(cfg: ModelConfig, seq_len: int, layers, f: dict | None = None) -> float:
    """Forward FLOPs per token of the given layers (MoE layers at their active FLOPs)."""
    f = f or flops_per_token(cfg, seq_len)
    return sum(f["moe_layer"] if cfg.is_moe_layer(i) else f["layer"] for i in layers)


def model_flops(cfg: ModelConfig, plan: Plan) -> float:
    """Useful FLOPs of one step: 3 x forward, over every token of the global batch."""
    f = flops_per_token(cfg, plan.seq_len)
    return 3.0 * (f["layers"] + f["head"]) * plan.global_batch * plan.seq_len


def hardware_flops(cfg: ModelConfig, plan: Plan) -> float:
    """Model FLOPs plus the forward work recomputation repeats."""
    f = flops_per_token(cfg, plan.seq_len)
    extra = {"none": 0, "selective": cfg.n_layers * f["attention"], "full": f["layers"]}[plan.recompute]
    return model_flops(cfg, plan) + extra * plan.global_batch * plan.seq_len
