"""Hugging Face tensor names <-> mini3d's: one table per family (`names`), each row a mini3d
parameter, the HF tensors whose rows it concatenates, and whether it is transposed (GPT-2's
Conv1D stores (in, out)). The llama-like families' separate q/k/v projections (and qwen2's q/k/v
biases) are the rows of mini3d's fused qkv; qwen3's per-head norms are `attn.q_norm` /
`attn.k_norm`. A tied head has no tensor of its own on either side.

A MoE layer (Mixtral, Qwen3-MoE) is read from either layout of its experts (hf_read's `_moe`,
which reads every HF state, a directory's or a dict's), layer by layer: the fused tensors of transformers 5's modules (`mlp.experts.gate_up_proj` (E, 2F, d),
gate rows first, and `mlp.experts.down_proj` (E, d, F), with the router at `mlp.gate`), or one
tensor per expert as the original repositories hold them and as transformers 5's save_pretrained
still writes them (Mixtral: `block_sparse_moe.experts.{j}.w1` gate, `w3` up, `w2` down, router
`block_sparse_moe.gate`; Qwen3-MoE: `mlp.experts.{j}.gate_proj`, `up_proj`, `down_proj`). mini3d
stacks them as `mlp.experts.w_gate`, `w_up` (E, F, d) and `w_down` (E, d, F), router
`mlp.router.weight`; its aux-loss-free `mlp.expert_bias` starts at zero. `to_hf_state` writes the
per-expert layout (`layout="fused"`: the modules' own tensors, e.g. to compare gradients).

DeepseekV3 (the deepseek family): the latent attention's tensors one to one (`_mla_attention`),
experts as Qwen3-MoE's under `mlp.experts`, the router's correction bias
`mlp.gate.e_score_correction_bias` as mini3d's `mlp.expert_bias` (read, not zeroed), and the
shared experts `mlp.shared_experts.{gate,up,down}_proj` as `mlp.shared.{gate,fc,proj}`.
"""

from __future__ import annotations

import torch

from mini3d.config import ModelConfig


def _gpt2_block(b: str, h: str) -> list[tuple[str, list[str], bool]]:
    out = []
    pairs = [("ln1", "ln_1"), ("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
             ("ln2", "ln_2"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")]
    for ours, theirs in pairs:
        conv = not ours.startswith("ln")  # GPT-2's Conv1D weight is (in, out)
        out.append((b + ours + ".weight", [h + theirs + ".weight"], conv))
        out.append((b + ours + ".bias", [h + theirs + ".bias"], False))
    return out


def llama_attention(b: str, h: str, cfg: ModelConfig) -> list[tuple[str, list[str], bool]]:
    """The attention rows (and both norms) of a llama-like block `b` (HF prefix `h`)."""
    a = h + "self_attn."
    out = [(b + "ln1.weight", [h + "input_layernorm.weight"], False),
           (b + "attn.qkv.weight", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
            False),
           (b + "attn.proj.weight", [a + "o_proj.weight"], False),
           (b + "ln2.weight", [h + "post_attention_layernorm.weight"], False)]
    if cfg.qkv_bias:
        out.append((b + "attn.qkv.bias", [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"],
                    False))
    if cfg.qk_norm:
        out += [(b + "attn.q_norm.weight", [a + "q_norm.weight"], False),
                (b + "attn.k_norm.weight", [a + "k_norm.weight"], False)]
    return out


def _llama_mlp(b: str, h: str) -> list[tuple[str, list[str], bool]]:
    return [(b + "mlp.gate.weight", [h + "mlp.gate_proj.weight"], False),
            (b + "mlp.fc.weight", [h + "mlp.up_proj.weight"], False),
            (b + "mlp.proj.weight", [h + "mlp.down_proj.weight"], False)]


PER_EXPERT = {"llama": ("block_sparse_moe", ("w1", "w3", "w2")),  # Mixtral: gate, up, down
              "qwen3": ("mlp", ("gate_proj", "up_proj", "down_proj")),  # Qwen3-MoE
              "deepseek": ("mlp", ("gate_proj", "up_proj", "down_proj"))}  # DeepseekV3


def _mla_attention(b: str, h: str, cfg: ModelConfig) -> list[tuple[str, list[str], bool]]:
    """The latent attention's tensors (and both block norms) of a deepseek block."""
    a = h + "self_attn."
    q = ([("q_a", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b", "q_b_proj")]
         if cfg.q_lora_rank else [("q", "q_proj")])
    pairs = q + [("kv_a", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"),
                 ("kv_b", "kv_b_proj"), ("proj", "o_proj")]
    return ([(b + "ln1.weight", [h + "input_layernorm.weight"], False),
             (b + "ln2.weight", [h + "post_attention_layernorm.weight"], False)]
            + [(f"{b}attn.{ours}.weight", [f"{a}{theirs}.weight"], False) for ours, theirs in pairs])


def _deepseek_moe_extras(b: str, h: str, cfg: ModelConfig) -> list[tuple[str, list[str], bool]]:
    """A deepseek MoE layer's tensors beside its experts and router: the shared experts' MLP."""
    if not cfg.n_shared_experts:
        return []
    s = h + "mlp.shared_experts."
    return [(b + "mlp.shared.gate.weight", [s + "gate_proj.weight"], False),
            (b + "mlp.shared.fc.weight", [s + "up_proj.weight"], False),
            (b + "mlp.shared.proj.weight", [s + "down_proj.weight"], False)]
OURS = ("experts.w_gate", "experts.w_up", "experts.w_down")


def moe_to_hf(state: dict, cfg: ModelConfig, i: int, layout: str = "per-expert") -> dict:
    """HF's tensors of MoE layer `i` (the inverse of hf_read's `_moe`), in `layout`."""
    b, h = f"blocks.{i}.mlp.", f"model.layers.{i}."
    gate, up, down = (state[b + o] for o in OURS)
    bias = {h + "mlp.gate.e_score_correction_bias": state[b + "expert_bias"].float().contiguous()} \
        if cfg.mla and b + "expert_bias" in state else {}  # (a gradient dict has none)
    if layout == "fused":
        return {h + "mlp.gate.weight": state[b + "router.weight"].contiguous(),
                h + "mlp.experts.gate_up_proj": torch.cat([gate, up], dim=1).contiguous(),
                h + "mlp.experts.down_proj": down.contiguous(), **bias}
    prefix, theirs = PER_EXPERT[cfg.family]
    out = {h + prefix + ".gate.weight": state[b + "router.weight"].contiguous(), **bias}
    for j in range(cfg.n_experts):
        for n, t in zip(theirs, (gate, up, down)):
            out[h + prefix + f".experts.{j}.{n}.weight"] = t[j].contiguous()
    return out


def names(cfg: ModelConfig) -> list[tuple[str, list[str], bool]]:
    """(mini3d name, HF names whose rows it concatenates, transposed?) for every tensor."""
    gpt2 = cfg.family == "gpt2"
    out = [("embed.wte.weight", ["transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"],
            False)]
    if gpt2:
        out.append(("embed.wpe.weight", ["transformer.wpe.weight"], False))
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", (f"transformer.h.{i}." if gpt2 else f"model.layers.{i}.")
        if gpt2:
            out += _gpt2_block(b, h)
            continue
        out += _mla_attention(b, h, cfg) if cfg.mla else llama_attention(b, h, cfg)
        if not cfg.is_moe_layer(i):  # (a MoE layer's experts: hf_read._moe / moe_to_hf)
            out += _llama_mlp(b, h)
        elif cfg.mla:
            out += _deepseek_moe_extras(b, h, cfg)
    ln_f = "transformer.ln_f." if gpt2 else "model.norm."
    out.append(("head.ln_f.weight", [ln_f + "weight"], False))
    if gpt2:
        out.append(("head.ln_f.bias", [ln_f + "bias"], False))
    if not cfg.tie_embeddings:
        out.append(("head.out.weight", ["lm_head.weight"], False))
    return out


def to_hf_state(state: dict, cfg: ModelConfig, layout: str = "per-expert") -> dict:
    """The HF state dict of mini3d's full named state (the inverse of hf_read.from_hf_state); MoE
    experts in `layout` ("per-expert" or "fused")."""
    out = {}
    for i in range(cfg.n_layers):
        if cfg.is_moe_layer(i):
            out.update(moe_to_hf(state, cfg, i, layout))
    for ours, theirs, transposed in names(cfg):
        t = state[ours].t() if transposed else state[ours]
        if len(theirs) == 1:
            out[theirs[0]] = t.contiguous()
            continue
        sizes = [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]  # q, k, v rows of the fused qkv (or its bias)
        for name, part in zip(theirs, t.split(sizes)):
            out[name] = part.contiguous()
    return out


__all__ = ["names", "to_hf_state", "llama_attention", "moe_to_hf"]
