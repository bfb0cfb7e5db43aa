"""The reference model: one pre-norm decoder-only transformer code path for every family.

`ModelConfig.family` picks the parts (see mini3d.models.config.ModelConfig):

    part            gpt2                                  llama (qwen2, qwen3: llama and ...)
    norm            LayerNorm (weight, bias)              RMSNorm (weight)
    positions       learned table (embed.wpe)             rotary, applied to q and k (base rope_base)
    attention       n_heads q, k and v heads              n_heads q heads, n_kv_heads k/v heads (GQA)
                                                          (qwen3: RMSNorm per q/k head, attn.q_norm)
    MLP             proj(gelu(fc x)), exact or tanh       proj(silu(gate x) * fc x)  (SwiGLU)
    biases          every linear layer but the head       none (qwen2: attn.qkv's)
    head            untied, or tied to embed.wte (any family: `tie_embeddings`)

Parameter names are the same for both families (`blocks.3.mlp.fc.weight`); `mini3d.checkpoint.hf` maps them
to and from Hugging Face's names (GPT2LMHeadModel, LlamaForCausalLM, Qwen2/Qwen3ForCausalLM).

Initialisation is a pure function of (seed, parameter name): each parameter is drawn from its own
generator, seeded from the seed and the parameter's name in the *full* model. So a pipeline stage
that builds only layers 2-3 gets exactly the weights those layers have in the full model, and a
tensor-parallel shard is sliced from the very tensor the single-process model would create: every
parallel layout starts bit-equal to the reference. A tied head is initialised under the name of the
embedding it shares (`canonical_name`), so a last pipeline stage that holds its own copy starts equal.

Dropout is off by default (p=0), so parity tests need no RNG choreography. Attention and rotary
positions live in mini3d.models.attention (re-exported here); its core
(scores, softmax, weighted sum) is written out so that its (T, T) activation is stored as in the
Megatron papers; it is what selective recomputation recomputes.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from mini3d.models.attention import Attention, dropout
from mini3d.models.config import ModelConfig
from mini3d.models.mla import MLA
from mini3d.models.moe import MoE
from mini3d.models.balance import carry_router_loss, router_loss
from mini3d.wgrad import Linear


def canonical_name(name: str, cfg: ModelConfig) -> str:
    """The name a parameter has in the single-process model: a tied head's weight is the token
    embedding's (`head.out.weight` -> `embed.wte.weight`); every other name is unchanged."""
    return "embed.wte.weight" if cfg.tie_embeddings and name == "head.out.weight" else name


def reference_init(name: str, shape: tuple, seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The float32 value the reference model gives parameter `name` (its name in the full model)."""
    name = canonical_name(name, cfg)
    is_norm = name.startswith("ln") or ".ln" in name or "_norm." in name  # (attn.q_norm: qwen3)
    if name.endswith(".bias") or is_norm:
        if is_norm and name.endswith(".weight"):
            return torch.ones(shape, device="cpu")
        return torch.zeros(shape, device="cpu")
    g = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    std = 0.02
    if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
        std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2's scaled residual projections
    return torch.randn(shape, generator=g, device="cpu").mul_(std)  # in place: no second full copy


def norm(cfg: ModelConfig) -> nn.Module:
    """The family's normalisation layer over d_model."""
    if cfg.llama_like:
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class MLP(nn.Module):
    """gpt2: proj(act(fc x)). llama (SwiGLU): proj(silu(gate x) * fc x), `fc` being Llama's up
    projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = Linear(cfg.d_model, cfg.d_ff, bias=cfg.biases)
        self.gate = Linear(cfg.d_model, cfg.d_ff, bias=False) if cfg.llama_like else None
        self.proj = Linear(cfg.d_ff, cfg.d_model, bias=cfg.biases)
        self.act = ACTIVATIONS[cfg.activation]
        self.drop = dropout(cfg)

    def forward(self, x):
        h = self.fc(x)  # (B, T, f)
        h = self.act(h) if self.gate is None else self.act(self.gate(x)) * h
        return self.drop(self.proj(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.ln1 = norm(cfg)
        self.attn = MLA(cfg) if cfg.mla else Attention(cfg)
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
        self.drop = dropout(cfg)

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
    A stage without the head but with MoE layers carries their router losses into its backward
    (`mini3d.models.balance.carry_router_loss`) and leaves their value in `carried_loss` for the
    pipeline runtime's reported loss.
    """

    positions = None  # (T,) default positions of this rank's tokens; None: 0..T-1
    router_loss_scale = 1.0  # gradient of a headless stage's router losses (the runtime's 1/m)
    carried_loss = None  # a headless stage's router losses of its latest forward (detached)

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
        aux = router_loss(self)  # a pipeline stage without the head: its own layers' share
        if torch.is_tensor(aux):
            self.carried_loss = aux.detach()
            x = carry_router_loss(x, aux, self.router_loss_scale)
        return x
