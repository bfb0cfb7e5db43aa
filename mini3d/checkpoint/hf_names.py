"""Hugging Face tensor names <-> mini3d's: one table per family (`names`), each row a mini3d
parameter, the HF tensors whose rows it concatenates, and whether it is transposed (GPT-2's
Conv1D stores (in, out)). The llama-like families' separate q/k/v projections (and qwen2's q/k/v
biases) are the rows of mini3d's fused qkv; qwen3's per-head norms are `attn.q_norm` /
`attn.k_norm`. A tied head has no tensor of its own on either side.
"""

from __future__ import annotations

import torch

from mini3d.checkpoint.hf_config import HFError
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


def names(cfg: ModelConfig) -> list[tuple[str, list[str], bool]]:
    """(mini3d name, HF names whose rows it concatenates, transposed?) for every tensor."""
    gpt2 = cfg.family == "gpt2"
    out = [("embed.wte.weight", ["transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"],
            False)]
    if gpt2:
        out.append(("embed.wpe.weight", ["transformer.wpe.weight"], False))
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", (f"transformer.h.{i}." if gpt2 else f"model.layers.{i}.")
        out += _gpt2_block(b, h) if gpt2 else llama_attention(b, h, cfg) + _llama_mlp(b, h)
    ln_f = "transformer.ln_f." if gpt2 else "model.norm."
    out.append(("head.ln_f.weight", [ln_f + "weight"], False))
    if gpt2:
        out.append(("head.ln_f.bias", [ln_f + "bias"], False))
    if not cfg.tie_embeddings:
        out.append(("head.out.weight", ["lm_head.weight"], False))
    return out


def from_hf_state(hf: dict, cfg: ModelConfig) -> dict:
    """mini3d's full named state from an HF state dict (float32, contiguous)."""
    out = {}
    for ours, theirs, transposed in names(cfg):
        missing = [n for n in theirs if n not in hf]
        if missing:
            raise HFError(f"the checkpoint has no tensor {missing[0]!r} (needed for {ours})")
        t = torch.cat([hf[n] for n in theirs]) if len(theirs) > 1 else hf[theirs[0]]
        out[ours] = (t.t() if transposed else t).float().contiguous()
    return out


def to_hf_state(state: dict, cfg: ModelConfig) -> dict:
    """The HF state dict of mini3d's full named state (the inverse of `from_hf_state`)."""
    out = {}
    for ours, theirs, transposed in names(cfg):
        t = state[ours].t() if transposed else state[ours]
        if len(theirs) == 1:
            out[theirs[0]] = t.contiguous()
            continue
        sizes = [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]  # q, k, v rows of the fused qkv (or its bias)
        for name, part in zip(theirs, t.split(sizes)):
            out[name] = part.contiguous()
    return out


__all__ = ["names", "from_hf_state", "to_hf_state", "llama_attention"]
