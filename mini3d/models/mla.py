"""Multi-head latent attention (MLA), the attention of the deepseek family (DeepSeek-V2 / V3).

Keys and values are not projected per head from x but expanded from one small latent per token;
queries likewise from a latent of their own (or, with `q_lora_rank=0` as DeepSeek-V2-Lite, by one
full projection). Each query/key head is the concatenation of a position-free part (qk_nope_dim
wide, from the latents) and a rotary part (qk_rope_dim wide); the key's rotary part is one head
shared by every query head, projected straight from x next to the kv latent. For x (B, T, d):

    q      = q_b(q_a_norm(q_a(x)))  or  q(x)         (B, T, n, nope + rope)
    c, k_r = split(kv_a(x))                           (B, T, kv_lora_rank), (B, T, rope)
    k_n, v = split(kv_b(kv_a_norm(c)))                (B, T, n, nope), (B, T, n, v_head_dim)
    q = [q_nope, rotary(q_rope)],  k = [k_n, rotary(k_r) for every head]
    y = proj(softmax(q k^T / sqrt(nope + rope)) v)    the attention core of mini3d.models.attention

The two latent RMSNorms use epsilon 1e-6 whatever `norm_eps` is, as the reference code and
transformers' DeepseekV3Attention do. `rope_interleave` reads the rotary features as DeepSeek's
checkpoints lay them out, pairs (2i, 2i+1): they are gathered into the (i, i + d/2) order of
`mini3d.models.attention.rotary` first, which rotates the same pairs by the same angles (q and k
alike, so the scores are those of the interleaved rotation).

The core is the same slot as `Attention.core` (explicit, sdpa, the KV cache); its softmax scale is
1/sqrt of q's width, nope + rope. YaRN (`yarn`: DeepSeek-V3's 128K extension, factor 40 over a
4096 context) changes three things, as the reference does: the rotary frequencies (`yarn_frequencies`:
interpolated by the factor below beta_slow rotations over the original context, kept above
beta_fast, a linear ramp between), cos and sin scaled by the attention factor
mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the softmax scale multiplied by
mscale(factor, mscale_all_dim)^2, here by scaling q (the same scores; mscale(s, m) = 0.1 m ln s + 1). The cache keeps the
expanded keys and values, not the latent a production decoder would keep: the same numbers.
Tensor parallelism (mini3d.tp.parallelize) splits the heads: it shrinks `n_local_heads`, makes
q_b / kv_b column- and proj row-parallel, keeps the latent down-projections whole, and sets
`share_key` to its `f` so the shared rotary key's gradient sums over the ranks' heads (under
sequence parallelism x is the rank's T/tp tokens: the latents and the rotary key are gathered
along the sequence instead, mini3d.tp.parallelize `_parallelize_mla`). Ring
attention (mini3d.cp) sends k and v as one message, so v goes in padded to k's width with zero
features (their outputs are zero and dropped): v_head_dim <= qk_nope_dim + qk_rope_dim there.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mini3d.models.attention import attention_core, dropout, rotary
from mini3d.models.config import ModelConfig
from mini3d.wgrad import Linear

LATENT_NORM_EPS = 1e-6  # the reference's RMSNorm default for q_a_norm and kv_a_norm


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Features (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): DeepSeek's rotary pairs
    (2i, 2i+1) become rotate-half's pairs (i, i + d/2)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_frequencies(dim: int, base: float, yarn: tuple, device=None) -> torch.Tensor:
    """YaRN's dim/2 rotary frequencies (see the module docstring), in float32."""
    factor, context, beta_fast, beta_slow = yarn[:4]
    beta_fast, beta_slow = beta_fast or 32, beta_slow or 1

    def rotations_dim(rotations):  # the feature index whose wavelength fits `rotations` times
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(rotations_dim(beta_fast)), 0)
    high = min(math.ceil(rotations_dim(beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    pos = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    keep = 1 - ((torch.arange(dim // 2, device=device).float() - low) / (high - low)).clamp(0, 1)
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class MLA(nn.Module):
    """Multi-head latent attention of one block (see the module docstring). Parameters: `q_a`,
    `q_a_norm`, `q_b` (or `q` when q_lora_rank is 0), `kv_a`, `kv_a_norm`, `kv_b`, `proj`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_local_heads = self.n_local_kv_heads = cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.rope_base, self.rope_scaling, self.interleave = cfg.rope_base, (), cfg.rope_interleave
        self.yarn, self.amplitude, self.q_scale = cfg.yarn, 1.0, 1.0
        if cfg.yarn:
            factor, _, _, _, mscale, mscale_all = cfg.yarn
            if mscale and mscale_all:
                self.amplitude = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
            else:
                self.amplitude = yarn_mscale(factor)
            self.q_scale = yarn_mscale(factor, mscale_all) ** 2 if mscale_all else 1.0
        h, n, qk = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.q = self.q_a = self.q_a_norm = self.q_b = None
        if cfg.q_lora_rank:
            self.q_a = Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b = Linear(cfg.q_lora_rank, n * qk, bias=False)
        else:
            self.q = Linear(h, n * qk, bias=False)
        self.kv_a = Linear(h, cfg.kv_lora_rank + cfg.qk_rope_dim, bias=False)  # [latent | k rope]
        self.kv_a_norm = nn.RMSNorm(cfg.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b = Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_dim + cfg.v_head_dim), bias=False)
        self.proj = Linear(n * cfg.v_head_dim, h, bias=False)
        self.drop = dropout(cfg)
        self.core = attention_core
        # the shared rotary key enters the heads through this: tensor parallelism's `f`
        # (identity forward, gradient summed over the ranks' heads backward), else nothing
        self.share_key = _same

    def _rotate(self, t, positions):
        if self.interleave:
            t = deinterleave(t)
        if not self.yarn:
            return rotary(t, self.rope_base, (), positions)
        inv_freq = yarn_frequencies(self.rope, self.rope_base, self.yarn, t.device)
        return rotary(t, self.rope_base, (), positions, inv_freq, self.amplitude)

    latent_cache = None  # a decoder's latent KV cache while one is open (mini3d.models.kv_cache)

    def forward(self, x: torch.Tensor, positions=None) -> torch.Tensor:
        n = self.n_local_heads
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.q is None else self.q(x)
        B, T, _ = q.shape  # the whole sequence even when x is a sequence shard (tp's sp)
        q = q.view(B, T, n, self.nope + self.rope).transpose(1, 2)  # (B, n, T, nope + rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_norm(latent)
        k_rope = self._rotate(self.share_key(k_rope).unsqueeze(1), positions)  # (B, 1, T, rope): one for all heads
        S = T  # key positions: this call's, or every cached one's while decoding
        if self.latent_cache is not None:  # mini3d.models.kv_cache.LatentCache: keeps the latent
            latent, k_rope = self.latent_cache.extend(latent, k_rope)
            S = latent.shape[1]
        kv = self.kv_b(latent).view(B, S, n, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, n, S, nope), (B, n, S, v)
        q = torch.cat([q_nope, self._rotate(q_rope, positions)], dim=-1)
        if self.q_scale != 1.0:  # YaRN's softmax scale
            q = q * self.q_scale
        k = torch.cat([k_nope, k_rope.expand(B, n, S, self.rope)], dim=-1)
        pad = q.shape[-1] - self.v_dim if getattr(self.core, "same_kv_width", False) else 0
        if pad:  # (ring attention: zero features of v give zero outputs, dropped again)
            y = self.core(q, k, F.pad(v, (0, pad)))[..., :self.v_dim]
        else:
            y = self.core(q, k, v.contiguous())  # (B, n, T, v)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, n * self.v_dim)))


__all__ = ["MLA", "deinterleave", "yarn_frequencies", "yarn_mscale", "LATENT_NORM_EPS"]
