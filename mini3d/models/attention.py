"""Attention of the reference model: rotary positions (llama), causal self-attention with
grouped-query heads, and its interchangeable cores (`CORES`: "explicit", which stores the (T, T)
scores as the Megatron papers count them, and "sdpa", PyTorch's fused kernel).

`Attention.core` is a slot: the KV cache (mini3d.models.kv_cache) and ring attention (mini3d.cp)
put their own core there, and tensor parallelism (mini3d.tp) shrinks `n_local_heads` /
`n_local_kv_heads` once it splits the heads; nothing else in the module changes.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mini3d.models.config import ModelConfig
from mini3d.wgrad import Linear


def rotary_frequencies(hd: int, base: float, scaling: tuple = (), device=None) -> torch.Tensor:
    """The hd/2 angular frequencies base^(-2i/hd); with Llama 3.1's `scaling` (factor, low, high,
    original context n): wavelengths longer than n/low are slowed by `factor`, those shorter than
    n/high kept, and the band between interpolated linearly in n/wavelength (Meta's published
    rescaling, which Hugging Face calls rope_type "llama3")."""
    inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, device=device).float() / hd))
    if not scaling:
        return inv_freq
    factor, low, high, n = scaling
    ratio = n * inv_freq / (2 * math.pi)  # original context / wavelength
    smooth = ((ratio - low) / (high - low)).clamp(0.0, 1.0)  # 0: slow down fully, 1: keep
    return inv_freq * (smooth + (1 - smooth) / factor)


def rotary(x: torch.Tensor, base: float, scaling: tuple = (), positions=None, inv_freq=None,
           amplitude: float = 1.0) -> torch.Tensor:
    """Rotary position embedding of q or k, (B, n, T, hd), at `positions` (T,) (default
    t = 0..T-1; a context-parallel rank passes its chunk's global positions): each pair of
    features (i, i + hd/2) is rotated by the angle t * frequency i (the "rotate half" layout of
    Hugging Face's Llama, whose checkpoints mini3d reads). Angles in float32. `inv_freq` given
    (deepseek's YaRN frequencies) replaces base and scaling; cos and sin are multiplied by
    `amplitude` (YaRN's attention factor; 1 otherwise)."""
    T, hd = x.shape[-2], x.shape[-1]
    if inv_freq is None:
        inv_freq = rotary_frequencies(hd, base, scaling, x.device)
    pos = torch.arange(T, device=x.device) if positions is None else positions
    freqs = torch.outer(pos.float(), inv_freq)  # (T, hd/2)
    angles = torch.cat([freqs, freqs], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if amplitude != 1.0:
        cos, sin = cos * amplitude, sin * amplitude
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def dropout(cfg: ModelConfig) -> nn.Module:
    """Dropout with p = cfg.dropout; no module at all when it is off (the default)."""
    return nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()


class Attention(nn.Module):
    """Causal self-attention with n_heads query heads and n_kv_heads key/value heads (equal for
    gpt2); query head i reads key/value head i // (n_heads / n_kv_heads). `n_local_heads` and
    `n_local_kv_heads` shrink once tensor parallelism splits the heads. Variants (see ModelConfig):
    `qkv_bias` (qwen2) biases q, k and v; `qk_norm` (qwen3) RMS-normalises each query and key head
    over its head_dim features (one weight shared by every head) before the rotation; heads
    `explicit_head_dim` wide make q and the projection's input n_heads * head_dim wide."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_local_heads, self.n_local_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.rope_base = cfg.rope_base if cfg.llama_like else None
        self.rope_scaling = cfg.rope_scaling
        # rows: [q heads | k heads | v heads]
        self.qkv = Linear(cfg.d_model, cfg.q_dim + 2 * cfg.kv_dim, bias=cfg.biases or cfg.qkv_bias)
        self.proj = Linear(cfg.q_dim, cfg.d_model, bias=cfg.biases)
        norm = (lambda: nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)) if cfg.qk_norm else (lambda: None)
        self.q_norm, self.k_norm = norm(), norm()
        self.drop = dropout(cfg)
        self.core = attention_core

    def forward(self, x: torch.Tensor, positions=None) -> torch.Tensor:
        # positions: (T,) global positions of x's tokens (a cp rank's chunk; default 0..T-1):
        # rotary attention rotates by them; learned positions were added by the embedding
        qkv = self.qkv(x)  # (B, T, q + 2kv); T is the whole sequence even when x is a sequence shard
        B, T, _ = qkv.shape
        hd, nq, nkv = self.head_dim, self.n_local_heads, self.n_local_kv_heads
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q = q.view(B, T, nq, hd).transpose(1, 2)  # (B, nq, T, hd)
        k, v = (t.view(B, T, nkv, hd).transpose(1, 2) for t in (k, v))  # (B, nkv, T, hd)
        if self.q_norm is not None:  # over each head's hd features
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_base is not None:
            q, k = (rotary(t, self.rope_base, self.rope_scaling, positions) for t in (q, k))
        y = self.core(q, k, v)  # (B, nq, T, hd)
        y = y.transpose(1, 2).reshape(B, T, nq * hd)
        return self.drop(self.proj(y))


def attention_core(q, k, v):
    """softmax(q k^T / sqrt(d)) v with a causal mask: the part selective recompute recomputes.

    Written out (rather than `F.scaled_dot_product_attention`, whose fused kernels never store the
    (T, T) attention matrix) so that the a*s^2 activation term of Korthikanti et al. is real and
    measurable here, and selective recomputation has something to save. Shapes: q (B, nh, T, hd),
    k and v (B, nkv, T, hd). With grouped-query attention (nkv < nh) the g = nh / nkv query heads
    of one key/value head are stacked along the sequence, (B, nkv, g*T, hd), so K and V are used
    (and saved for backward) at their own, smaller size instead of being repeated g times."""
    B, nh, T, hd = q.shape
    g = nh // k.shape[1]
    if g > 1:
        q = q.reshape(B, k.shape[1], g * T, hd)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, nkv, g*T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    if g > 1:
        causal = causal.repeat(g, 1)
    att = torch.softmax(att.masked_fill(causal, float("-inf")), dim=-1)
    y = att @ v  # (B, nkv, g*T, v's width: hd, or MLA's v_head_dim)
    return y.view(B, nh, T, v.shape[-1]) if g > 1 else y  # (B, nh, T, hd)


def sdpa_core(q, k, v):
    """The same attention through `F.scaled_dot_product_attention` (`Plan.attention="sdpa"`): a
    fused kernel (flash / memory-efficient on GPUs, a flash-style one on CPUs) that keeps only its
    output and a log-sum-exp per row, never the (T, T) matrix. What a real run on GPUs wants;
    equal to `attention_core` up to summation order."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


CORES = {"explicit": attention_core, "sdpa": sdpa_core}


def set_attention(model: nn.Module, kind: str) -> nn.Module:
    """Give every attention layer of a GPT (or pipeline stage) the core `kind` ("explicit", "sdpa")."""
    for block in getattr(model, "blocks", {}).values():
        block.attn.core = CORES[kind]
    return model
