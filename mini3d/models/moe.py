"""A mixture-of-experts MLP: router, top-k dispatch, stacked experts, load-balancing losses.

`MoE` takes the place of a block's dense MLP (`blocks.{i}.mlp`) in the layers
`ModelConfig.is_moe_layer` names. For N tokens x (N, d):

    logits = router(x)                          (N, E)   a bias-free Linear d -> E
    weights, experts = ROUTERS[cfg.router](...)  (N, k)   which k experts each token uses, and how much
    y[t] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t])   (+ shared(x) with shared experts)

Routers (`--router`): `softmax` keeps the top-k of the softmax (Qwen3-MoE with norm_topk_prob
off), `softmax-norm` renormalises those k to sum to one (Mixtral, whose softmax over the top-k
logits is the same thing, and Qwen3-MoE), `sigmoid` picks the top-k of sigmoid scores plus a
per-expert bias and weights by the renormalised scores (DeepSeek-V3's aux-loss-free balancing: the
bias, a float32 buffer outside the optimizer, moves by `router_bias_rate` towards the under-loaded
experts after each step, `update_expert_bias`).

Experts are stacked on dim 0 (`experts.w_gate`, `w_up` (E, F, d), `w_down` (E, d, F)); the tokens
of each expert are contiguous after a stable sort, and their matmuls run as one grouped GEMM
(`torch._grouped_mm`) where this torch supports the dtype and shapes, a loop over experts
otherwise: the same numbers (tests/test_moe.py).

Capacity (`capacity_factor` C > 0): expert e takes at most ceil(C * N * k / E) of its assignments,
those with the largest router weights (Megatron's "probs" drop policy); the rest are dropped (the
token keeps its other experts and the residual). C = 0 is dropless.

Losses (`router_loss`, added to the model's loss by `GPT.forward`): the switch-style
load-balancing loss E * sum_e f_e P_e, with f_e the fraction of token-slots routed to e and P_e
the mean router probability of e, both pooled over every MoE layer of the module as
transformers' `load_balancing_loss_func` pools them; and the z-loss mean_t logsumexp(logits_t)^2
(ST-MoE), averaged over the layers. The per-step load (tokens each expert processed, summed over
layers and micro-batches, all-reduced over the data-parallel ranks) is what `--log-jsonl` reports.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mini3d import comm
from mini3d.models.config import ModelConfig


class SoftmaxRouter:
    """Top-k of softmax(logits); `norm`: the k weights renormalised to sum to one."""

    def __init__(self, norm: bool):
        self.norm = norm

    def probs(self, logits):
        """(N, E) float32 probabilities the balancing loss reads."""
        return torch.softmax(logits.float(), dim=-1)

    def route(self, logits, k: int, bias):
        probs = self.probs(logits)
        weights, experts = torch.topk(probs, k, dim=-1)  # (N, k)
        if self.norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts, probs


class SigmoidRouter:
    """DeepSeek-V3: experts chosen by top-k of sigmoid(logits) + bias, weighted by the chosen
    sigmoid scores renormalised (the bias steers the choice only)."""

    def probs(self, logits):
        s = torch.sigmoid(logits.float())
        return s / s.sum(dim=-1, keepdim=True)

    def route(self, logits, k: int, bias):
        scores = torch.sigmoid(logits.float())
        experts = torch.topk(scores + bias, k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, experts)
        return weights / weights.sum(dim=-1, keepdim=True), experts, scores / scores.sum(-1, keepdim=True)


class GroupedSigmoidRouter(SigmoidRouter):
    """DeepSeek-V3's full sigmoid routing: the E experts form `groups` equal groups, each scored
    by the sum of its two best biased scores; a token chooses its top-k experts among those of its
    `topk_groups` best groups only (node-limited routing), weighted by their sigmoid scores,
    renormalised when `norm` (norm_topk_prob; + 1e-20 in the denominator, as the reference),
    times `scale` (routed_scaling_factor). groups=1, norm, scale=1 is `SigmoidRouter`'s choice."""

    def __init__(self, groups: int, topk_groups: int, scale: float, norm: bool):
        self.groups, self.topk_groups, self.scale, self.norm = groups, topk_groups, scale, norm

    def route(self, logits, k: int, bias):
        scores = torch.sigmoid(logits.float())
        choice = scores + bias  # (N, E)
        if self.groups > 1:
            N, E = choice.shape
            by_group = choice.view(N, self.groups, E // self.groups)
            group_score = by_group.topk(2, dim=-1).values.sum(-1)  # (N, G)
            best = group_score.topk(self.topk_groups, dim=-1).indices  # (N, topk_groups)
            allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(E // self.groups, 1),
                                        float("-inf"))
        experts = torch.topk(choice, k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, experts)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, experts, scores / scores.sum(-1, keepdim=True)


ROUTERS = {"softmax": SoftmaxRouter(norm=False), "softmax-norm": SoftmaxRouter(norm=True),
           "sigmoid": SigmoidRouter()}


def router_for(cfg: ModelConfig):
    """The router of `cfg`: ROUTERS[cfg.router], or the grouped sigmoid router when any of
    DeepSeek-V3's options (route_groups, routed_scaling_factor, norm_topk_prob off) is set."""
    grouped = (cfg.route_groups, cfg.routed_scaling_factor, cfg.norm_topk_prob) != (1, 1.0, True)
    if cfg.router == "sigmoid" and grouped:
        return GroupedSigmoidRouter(cfg.route_groups, cfg.route_topk_groups,
                                    cfg.routed_scaling_factor, cfg.norm_topk_prob)
    return ROUTERS[cfg.router]


def capacity(cfg: ModelConfig, n_tokens: int) -> int:
    """Most assignments one expert takes: ceil(C * tokens * top_k / E) (0: no limit)."""
    if not cfg.capacity_factor:
        return 0
    return math.ceil(cfg.capacity_factor * n_tokens * cfg.top_k / cfg.n_experts)


def keep_within_capacity(experts, weights, cap: int):
    """(N*k,) bool: the assignments kept when each expert takes its `cap` highest-weighted ones
    (ties in token order)."""
    by_weight = torch.argsort(-weights, stable=True)
    order = by_weight[torch.argsort(experts[by_weight], stable=True)]  # by expert, then weight
    counts = torch.bincount(experts, minlength=int(experts.max()) + 1)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(order), device=experts.device) - starts[experts[order]]
    keep = torch.empty_like(experts, dtype=torch.bool)
    keep[order] = rank < cap
    return keep


def grouped_mm_supported(x: torch.Tensor, *ws: torch.Tensor) -> bool:
    """Can `torch._grouped_mm` run these operands here: CPU float32/bf16/fp16 or CUDA bf16, every
    row stride a multiple of 16 bytes (what the kernel requires)."""
    if not hasattr(torch, "_grouped_mm") or not GROUPED_MM["enabled"]:
        return False
    ok = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}
    if x.dtype not in ok.get(x.device.type, ()):
        return False
    align = 16 // x.element_size()
    return all(d % align == 0 for w in ws for d in w.shape[1:])


GROUPED_MM = {"enabled": True}  # tests turn it off to compare with the loop


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())  # the grouped kernel's backward needs it
    return t


def expert_matmul(x, w, counts, grouped: bool):
    """x (M, in) sorted by expert, w (E, out, in), counts (E,): x[rows of e] @ w[e]^T, stacked."""
    if grouped:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return _contiguous_grad(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    parts = [x[s:s + n] @ w[e].T for e, (s, n) in enumerate(zip(
        (torch.cumsum(counts, 0) - counts).tolist(), counts.tolist())) if n]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])


class Experts(nn.Module):
    """E expert MLPs stacked on dim 0: llama down(silu(gate x) * up x), gpt2 down(act(up x))."""

    def __init__(self, cfg: ModelConfig, act):
        super().__init__()
        E, f, d = cfg.n_experts, cfg.moe_width, cfg.d_model
        self.w_gate = nn.Parameter(torch.empty(E, f, d)) if cfg.llama_like else None
        self.w_up = nn.Parameter(torch.empty(E, f, d))
        self.w_down = nn.Parameter(torch.empty(E, d, f))
        self.act = act

    def forward(self, x, counts):
        """x (M, d): the routed tokens sorted by expert; counts (E,) tokens per expert."""
        ws = [w for w in (self.w_gate, self.w_up, self.w_down) if w is not None]
        grouped = grouped_mm_supported(x, *ws)
        h = expert_matmul(x, self.w_up, counts, grouped)  # (M, F)
        if self.w_gate is None:
            h = self.act(h)
        else:
            h = self.act(expert_matmul(x, self.w_gate, counts, grouped)) * h
        return expert_matmul(h, self.w_down, counts, grouped)  # (M, d)


class MoE(nn.Module):
    """The mixture-of-experts MLP of one block (see the module docstring). `mlp_class` builds the
    shared experts' ordinary MLP (mini3d.models.transformer.MLP), `act` is the family's activation.
    After each forward, `self.stats` holds what the losses and the load report read."""

    def __init__(self, cfg: ModelConfig, act, mlp_class=None):
        super().__init__()
        self.cfg, self.router_kind = cfg, router_for(cfg)
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg, act)
        width = cfg.moe_width * cfg.n_shared_experts
        self.shared = mlp_class(dataclasses.replace(cfg, d_ff=width)) if width else None
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        self.stats = None

    def forward(self, x):
        B, T, d = x.shape
        flat = x.reshape(-1, d)  # (N, d)
        logits = self.router(flat)  # (N, E)
        weights, experts, probs = self.router_kind.route(logits, self.cfg.top_k, self.expert_bias)
        N, k, E = flat.shape[0], self.cfg.top_k, self.cfg.n_experts
        e, w = experts.reshape(-1), weights.reshape(-1).to(x.dtype)  # (N*k,) token-slots
        tok = torch.arange(N, device=x.device).repeat_interleave(k)
        selected = torch.bincount(e, minlength=E)
        cap = capacity(self.cfg, N)
        if cap:
            keep = keep_within_capacity(e, w, cap)
            e, w, tok = e[keep], w[keep], tok[keep]
        order = torch.argsort(e, stable=True)
        e, w, tok = e[order], w[order], tok[order]
        counts = torch.bincount(e, minlength=E)  # tokens each expert processes
        out = self.experts(flat[tok], counts) * w[:, None]
        y = flat.new_zeros(N, d).index_add(0, tok, out)
        if self.shared is not None:
            y = y + self.shared(flat)
        self.stats = {"logits": logits, "probs_sum": probs.sum(0), "selected": selected,
                      "counts": counts.detach(), "dropped": N * k - len(e), "tokens": N}
        return y.view(B, T, d)


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def router_loss(module: nn.Module):
    """aux_loss_coef x the pooled switch loss + z_loss_coef x the mean z-loss over the module's
    MoE layers, from their latest forward (0.0 without MoE layers or coefficients); part of every
    loss GPT.forward returns, validation losses included (as transformers' Mixtral adds it). In
    training it also adds each layer's counts to the step's load (`step_load`)."""
    layers = [m for m in moe_layers(module) if m.stats is not None]
    if not layers:
        return 0.0
    cfg = layers[0].cfg
    if torch.is_grad_enabled() and module.training:
        for m in layers:
            m._load = m.stats["counts"].double() + getattr(m, "_load", 0.0)
            m._dropped = m.stats["dropped"] + getattr(m, "_dropped", 0)
    loss = 0.0
    if cfg.aux_loss_coef:
        rows = sum(m.stats["tokens"] for m in layers)
        f = sum(m.stats["selected"] for m in layers).float() / rows  # sums to top_k
        p = sum(m.stats["probs_sum"] for m in layers) / rows
        loss = loss + cfg.aux_loss_coef * cfg.n_experts * (f * p).sum()
    if cfg.z_loss_coef:
        z = sum(torch.logsumexp(m.stats["logits"].float(), -1).square().mean() for m in layers)
        loss = loss + cfg.z_loss_coef * z / len(layers)
    return loss


@torch.no_grad()
def step_load(module: nn.Module, group=None) -> dict:
    """The step's expert load, summed over the module's MoE layers and micro-batches (and over the
    ranks of `group`, the data-parallel ranks): tokens per expert min / max / coefficient of
    variation, and dropped token-slots. Updates the aux-loss-free biases (router_bias_rate) from
    each layer's own load, then resets the loads. {} without MoE layers."""
    layers = [m for m in moe_layers(module) if hasattr(m, "_load")]
    if not layers:
        return {}
    flat = torch.cat([torch.stack([m._load for m in layers]).flatten(),
                      torch.tensor([float(sum(m._dropped for m in layers))], dtype=torch.float64,
                                   device=layers[0]._load.device)])
    if group is not None and group.size > 1:
        comm.all_reduce(flat, group)
    E = layers[0].cfg.n_experts
    loads = flat[:-1].view(len(layers), E)
    for m, load in zip(layers, loads):
        if m.cfg.router_bias_rate:  # DeepSeek-V3: raise the under-loaded, lower the over-loaded
            m.expert_bias += m.cfg.router_bias_rate * torch.sign(load.mean() - load).float()
        del m._load, m._dropped
    total = loads.sum(0)
    cv = float(total.std(correction=0) / total.mean()) if total.mean() > 0 else 0.0
    return {"expert_load_min": int(total.min()), "expert_load_max": int(total.max()),
            "expert_load_cv": cv, "dropped_tokens": int(flat[-1])}
