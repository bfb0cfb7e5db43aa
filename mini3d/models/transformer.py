"""The reference model: one pre-norm decoder-only transformer code path for every family.

`ModelConfig.family` picks the parts (see mini3d.models.config.ModelConfig):

    part            gpt2                                  llama
    norm            LayerNorm (weight, bias)              RMSNorm (weight)
    positions       learned table (embed.wpe)             rotary, applied to q and k (base rope_base)
    attention       n_heads q, k and v heads              n_heads q heads, n_kv_heads k/v heads (GQA)
    MLP             proj(gelu(fc x)), exact or tanh       proj(silu(gate x) * fc x)  (SwiGLU)
    biases          every linear layer but the head       none
    head            untied, or tied to embed.wte (either family: `tie_embeddings`)

Parameter names are the same for both families (`blocks.3.mlp.fc.weight`); `mini3d.checkpoint.hf` maps them
to and from Hugging Face's GPT2LMHeadModel / LlamaForCausalLM names.

Initialisation is a pure function of (seed, parameter name): each parameter is drawn from its own
generator, seeded from the seed and the parameter's name in the *full* model. So a pipeline stage
that builds only layers 2-3 gets exactly the weights those layers have in the full model, and a
tensor-parallel shard is sliced from the very tensor the single-process model would create: every
parallel layout starts bit-equal to the reference. A tied head is initialised under the name of the
embedding it shares (`canonical_name`), so a last pipeline stage that holds its own copy starts equal.

Dropout is off by default (p=0), so parity tests need no RNG choreography. The attention core
(scores, softmax, weighted sum) is written out so that its (T, T) activation is stored as in the
Megatron papers; it is what selective recomputation recomputes.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from mini3d.models.config import ModelConfig
from mini3d.models.moe import MoE, router_loss
from mini3d.wgrad import Linear


def canonical_name(name: str, cfg: ModelConfig) -> str:
    """The name a parameter has in the single-process model: a tied head's weight is the token
    embedding's (`head.out.weight` -> `embed.wte.weight`); every other name is unchanged."""
    return "embed.wte.weight" if cfg.tie_embeddings and name == "head.out.weight" else name


def reference_init(name: str, shape: tuple, seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The float32 value the reference model gives parameter `name` (its name in the full model)."""
    name = canonical_name(name, cfg)
    if name.endswith(".bias") or name.startswith("ln") or ".ln" in name:
        if (name.startswith("ln") or ".ln" in name) and name.endswith(".weight"):
            return torch.ones(shape, device="cpu")
        return torch.zeros(shape, device="cpu")
    g = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    std = 0.02
    if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
        std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2's scaled residual projections
    return torch.randn(shape, generator=g, device="cpu").mul_(std)  # in place: no second full copy


def norm(cfg: ModelConfig) -> nn.Module:
    """The family's normalisation layer over d_model."""
    if cfg.family == "llama":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


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


def rotary(x: torch.Tensor, base: float, scaling: tuple = (), positions=None) -> torch.Tensor:
    """Rotary position embedding of q or k, (B, n, T, hd), at `positions` (T,) (default
    t = 0..T-1; a context-parallel rank passes its chunk's global positions): each pair of
    features (i, i + hd/2) is rotated by the angle t * frequency i (the "rotate half" layout of
    Hugging Face's Llama, whose checkpoints mini3d reads). Angles in float32."""
    T, hd = x.shape[-2], x.shape[-1]
    inv_freq = rotary_frequencies(hd, base, scaling, x.device)
    pos = torch.arange(T, device=x.device) if positions is None else positions
    freqs = torch.outer(pos.float(), inv_freq)  # (T, hd/2)
    angles = torch.cat([freqs, freqs], dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _dropout(cfg: ModelConfig) -> nn.Module:
    """Dropout with p = cfg.dropout; no module at all when it is off (the default)."""
    return nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()


class Attention(nn.Module):
    """Causal self-attention with n_heads query heads and n_kv_heads key/value heads (equal for
    gpt2); query head i reads key/value head i // (n_heads / n_kv_heads). `n_local_heads` and
    `n_local_kv_heads` shrink once tensor parallelism splits the heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_local_heads, self.n_local_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.rope_base = cfg.rope_base if cfg.family == "llama" else None
        self.rope_scaling = cfg.rope_scaling
        # rows: [q heads | k heads | v heads]
        self.qkv = Linear(cfg.d_model, cfg.d_model + 2 * cfg.kv_dim, bias=cfg.biases)
        self.proj = Linear(cfg.d_model, cfg.d_model, bias=cfg.biases)
        self.drop = _dropout(cfg)
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
    y = att @ v  # (B, nkv, g*T, hd)
    return y.view(B, nh, T, hd) if g > 1 else y  # (B, nh, T, hd)


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


ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class MLP(nn.Module):
    """gpt2: proj(act(fc x)). llama (SwiGLU): proj(silu(gate x) * fc x), `fc` being Llama's up
    projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = Linear(cfg.d_model, cfg.d_ff, bias=cfg.biases)
        self.gate = Linear(cfg.d_model, cfg.d_ff, bias=False) if cfg.family == "llama" else None
        self.proj = Linear(cfg.d_ff, cfg.d_model, bias=cfg.biases)
        self.act = ACTIVATIONS[cfg.activation]
        self.drop = _dropout(cfg)

    def forward(self, x):
        h = self.fc(x)  # (B, T, f)
        h = self.act(h) if self.gate is None else self.act(self.gate(x)) * h
        return self.drop(self.proj(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.ln1 = norm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = norm(cfg)
        self.mlp = MoE(cfg, ACTIVATIONS[cfg.activation], MLP) if cfg.is_moe_layer(layer) else MLP(cfg)

    def forward(self, x, positions=None):
        x = x + self.attn(self.ln1(x), positions)
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token embeddings, + learned position embeddings (gpt2 family; llama's are rotary)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.family == "gpt2" else None
        self.drop = _dropout(cfg)

    def forward(self, idx, positions=None):
        """positions: (T,) global positions of the tokens (default 0..T-1)."""
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            pos = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
            x = x + self.wpe(pos)
        return self.drop(x)


def cross_entropy(logits, targets):
    """Mean token-level cross-entropy; logits (B, T, V), targets (B, T)."""
    z = logits.reshape(-1, logits.shape[-1])  # in float32 at least (float64 stays float64)
    return F.cross_entropy(z.to(torch.promote_types(z.dtype, torch.float32)), targets.reshape(-1))


class Head(nn.Module):
    """Final norm, output projection and mean cross-entropy over all tokens."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_f = norm(cfg)
        self.out = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.loss_fn = cross_entropy  # tensor parallelism swaps in the vocab-parallel version

    def forward(self, x, targets=None):
        logits = self.out(self.ln_f(x))  # (B, T, V)
        return logits if targets is None else self.loss_fn(logits, targets)


def tie_weights(model: nn.Module) -> nn.Module:
    """Make a module holding both ends of a tied model use one Parameter for the token embedding
    and the head (again, after a transform replaced either). A pipeline stage holding only one end
    keeps its own copy; the trainer sums the two copies' gradients (mini3d.pp.tied)."""
    if model.cfg.tie_embeddings and model.embed is not None and model.head is not None:
        model.head.out.weight = model.embed.wte.weight
    return model


class GPT(nn.Module):
    """The whole model of any family, or one pipeline stage of it.

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
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in self.layer_ids})
        self.head = Head(cfg) if last else None
        tie_weights(self)
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
        if self.head is not None:  # + the routers' balancing losses (mini3d.models.moe)
            out = self.head(x, targets)
            return out if targets is None else out + router_loss(self)
        return x
