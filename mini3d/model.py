"""The reference GPT: pre-LayerNorm, causal self-attention, GELU MLP, untied output head, no dropout.

Initialisation is a pure function of (seed, parameter name): each parameter is drawn from its own
generator, seeded from the seed and the parameter's name in the *full* model (e.g.
`blocks.3.mlp.fc.weight`). So a pipeline stage that builds only layers 2-3 gets exactly the weights
those layers have in the full model, and a tensor-parallel shard is sliced from the very tensor the
single-process model would create: every parallel layout starts bit-equal to the reference.

Choices, documented: the head is untied from the token embedding (so the first and last pipeline
stages share no parameter and need no embedding all-reduce); dropout is absent (p=0), so parity tests
need no RNG choreography. The attention core (scores, softmax, weighted sum) is written out so that
its (T, T) activation is stored as in the Megatron papers; it is what selective recomputation recomputes.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig


def reference_init(name: str, shape: tuple, seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The float32 value the reference model gives parameter `name` (its name in the full model)."""
    if name.endswith(".bias") or name.startswith("ln") or ".ln" in name:
        if (name.startswith("ln") or ".ln" in name) and name.endswith(".weight"):
            return torch.ones(shape)
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    std = 0.02
    if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
        std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2's scaled residual projections
    return torch.randn(shape, generator=g) * std


class Attention(nn.Module):
    """Causal multi-head self-attention. `n_local_heads` < n_heads once tensor parallelism splits heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_local_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # rows: [q heads | k heads | v heads]
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.core = attention_core

    def forward(self, x: torch.Tensor, positions=None) -> torch.Tensor:
        # positions: (T,) global positions of x's tokens (a cp rank's chunk); learned positions are
        # added by the embedding, so this attention does not read them (rotary attention would)
        qkv = self.qkv(x)  # (B, T, 3C); T is the whole sequence even when x is a sequence shard
        B, T, _ = qkv.shape
        q, k, v = qkv.split(self.n_local_heads * self.head_dim, dim=-1)
        q, k, v = (t.view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_local_heads * self.head_dim)
        return self.proj(y)


def attention_core(q, k, v):
    """softmax(q k^T / sqrt(d)) v with a causal mask: the part selective recompute recomputes.

    Written out (rather than `F.scaled_dot_product_attention`, whose fused kernels never store the
    (T, T) attention matrix) so that the a*s^2 activation term of Korthikanti et al. is real and
    measurable here, and selective recomputation has something to save. Shapes: q, k, v (B, nh, T, hd).
    """
    T = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, nh, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    att = torch.softmax(att.masked_fill(causal, float("-inf")), dim=-1)
    return att @ v  # (B, nh, T, hd)


def sdpa_core(q, k, v):
    """The same attention through `F.scaled_dot_product_attention` (`Plan.attention="sdpa"`): a
    fused kernel (flash / memory-efficient on GPUs, a flash-style one on CPUs) that keeps only its
    output and a log-sum-exp per row, never the (T, T) matrix. What a real run on GPUs wants;
    equal to `attention_core` up to summation order."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


CORES = {"explicit": attention_core, "sdpa": sdpa_core}


def set_attention(model: nn.Module, kind: str) -> nn.Module:
    """Give every attention layer of a GPT (or pipeline stage) the core `kind` ("explicit", "sdpa")."""
    for block in getattr(model, "blocks", {}).values():
        block.attn.core = CORES[kind]
    return model


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x, positions=None):
        x = x + self.attn(self.ln1(x), positions)
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token + learned position embeddings."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)

    def forward(self, idx, positions=None):
        """positions: (T,) global positions of the tokens (default 0..T-1)."""
        pos = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        return self.wte(idx) + self.wpe(pos)  # (B, T, C)


def cross_entropy(logits, targets):
    """Mean token-level cross-entropy; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class Head(nn.Module):
    """Final LayerNorm, output projection and mean cross-entropy over all tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.loss_fn = cross_entropy  # tensor parallelism swaps in the vocab-parallel version

    def forward(self, x, targets=None):
        logits = self.out(self.ln_f(x))  # (B, T, V)
        return logits if targets is None else self.loss_fn(logits, targets)


class GPT(nn.Module):
    """The whole model, or one pipeline stage of it.

    `layers` picks which blocks this module holds (global indices, default all); `first` adds the
    embedding (input: token ids), `last` adds the head (output: the loss when targets are given).
    A middle stage maps hidden states (B, T, C) to hidden states. `positions` (T,) are the global
    positions of the T tokens (under context parallelism a rank holds a zig-zag chunk of each
    sequence); when not given, those set on the module (`self.positions`, see mini3d.cp), else 0..T-1.
    """

    positions = None  # (T,) default positions of this rank's tokens; None: 0..T-1

    def __init__(self, cfg: ModelConfig, seed: int = 0, layers=None, first: bool = True,
                 last: bool = True, init: bool = True):
        super().__init__()
        self.cfg, self.first, self.last = cfg, first, last
        layers = range(cfg.n_layers) if layers is None else layers
        self.layer_ids = list(layers)
        self.embed = Embedding(cfg) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in self.layer_ids})
        self.head = Head(cfg) if last else None
        if init:  # init=False: shapes only (e.g. on the meta device; see materialize_reference)
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int):
        for name, p in self.named_parameters():
            p.copy_(reference_init(name, tuple(p.shape), seed, self.cfg))

    def forward(self, x, targets=None, positions=None):
        positions = self.positions if positions is None else positions
        if self.embed is not None:
            x = self.embed(x, positions)
        for block in self.blocks.values():
            x = block(x, positions)
        if self.head is not None:
            return self.head(x, targets)
        return x
