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
token keeps its other experts and the residual). C = 0 is dropless. Under expert parallelism (mini3d.ep) each rank applies it to its own tokens
(N is the rank's), as the one-process run does to each micro-batch.

Losses (`router_loss`, added to the model's loss by `GPT.forward`): the switch-style
load-balancing loss E * sum_e f_e P_e, with f_e the fraction of token-slots routed to e and P_e
the mean router probability of e, both pooled over every MoE layer of the module as
transformers' `load_balancing_loss_func` pools them (`aux_loss_scope` "model"), or each layer's
own loss summed over the layers as Megatron-Core adds them ("layer", what a pipeline stage can
compute for its layers); and the z-loss mean_t logsumexp(logits_t)^2 (ST-MoE), averaged over the
model's MoE layers. Under the splits (`pool_router_stats_over`, `carry_router_loss`) these equal
the one-process losses (tests/test_moe_splits.py). The per-step load (tokens each expert
processed, summed over layers and micro-batches, all-reduced over the data-parallel ranks, the
tp ranks under sequence parallelism and the pipeline stages) is what `--log-jsonl` reports:
`expert_load` (one count per expert) and its min / max / coefficient of variation.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mini3d import comm
from mini3d.models.config import ModelConfig


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float32 at least (bf16 logits widened; a float64 run's stay float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class SoftmaxRouter:
    """Top-k of softmax(logits); `norm`: the k weights renormalised to sum to one."""

    def __init__(self, norm: bool):
        self.norm = norm

    def probs(self, logits):
        """(N, E) float32 probabilities the balancing loss reads."""
        return torch.softmax(_wide(logits), dim=-1)

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
        s = torch.sigmoid(_wide(logits))
        return s / s.sum(dim=-1, keepdim=True)

    def route(self, logits, k: int, bias):
        scores = torch.sigmoid(_wide(logits))
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
        self.dispatch = None  # expert parallelism: mini3d.ep's ExpertDispatch runs the experts

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
        out = (self.dispatch or self.experts)(flat[tok], counts) * w[:, None]
        y = flat.new_zeros(N, d).index_add(0, tok, out)
        if self.shared is not None:
            y = y + self.shared(flat)
        self.stats = {"logits": logits, "probs_sum": probs.sum(0), "selected": selected,
                      "counts": counts.detach(), "dropped": N * k - len(e), "tokens": N}
        return y.view(B, T, d)


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def n_moe_layers(cfg: ModelConfig) -> int:
    """MoE layers of the whole model (a pipeline stage holds some of them)."""
    return sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))


def has_router_loss(cfg: ModelConfig) -> bool:
    """Does the model's loss hold router losses (a MoE layer and a non-zero coefficient)?"""
    return n_moe_layers(cfg) > 0 and bool(cfg.aux_loss_coef or cfg.z_loss_coef)


class _PooledSum(torch.autograd.Function):
    """Sum over the ranks of `axis` (forward); backward: the gradient times `scale`, no
    communication (see `pool_router_stats_over`)."""

    @staticmethod
    def forward(ctx, t, axis, scale: float):
        ctx.scale = scale
        out = t.clone()
        comm.all_reduce(out, axis)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None


def pool_router_stats_over(module: nn.Module, axes) -> None:
    """Make the router losses of `module`'s MoE layers pool their statistics over the ranks that
    hold one micro-batch's tokens: `axes`, [(axis, gradient scale)].

    The losses are not sums over tokens (the balancing loss multiplies two token means), so a rank
    holding part of the tokens cannot compute its share alone: each layer's per-expert counts,
    probability sums, squared-logsumexp sum and token count are summed over `axes` first (one
    all-reduce per axis per forward, no communication in backward), and every rank of the group
    then holds the whole micro-batch's loss. Its gradient reaches each rank's own tokens; what
    follows makes the sum over the group the one-process gradient:

    * sequence parallelism (tp, scale 1): the trainer sums the replicated parameters' gradients
      over tp (`mini3d.tp.sum_replicated_grads`), as for the norms;
    * context parallelism (cp, scale cp): the gradients are averaged over cp x dp like replicas',
      so each cp rank's part is scaled by cp to undo the 1/cp.
    """
    for m in moe_layers(module):
        m.token_axes = [(axis, float(scale)) for axis, scale in axes if axis.size > 1]


def carry_router_loss(x: torch.Tensor, loss, scale: float) -> torch.Tensor:
    """x unchanged; in backward, `loss` also gets the gradient `scale`: a pipeline stage's own
    router losses join the backward through its output (the stage holds no loss to add them to;
    `scale` is the runtime's 1/micro-batches, what the last stage's loss gets)."""
    if not torch.is_tensor(loss) or not loss.requires_grad or not torch.is_grad_enabled():
        return x
    return _Carry.apply(x, loss, scale)


class _Carry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, loss, scale: float):
        ctx.scale, ctx.loss_meta = scale, (loss.shape, loss.dtype)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=grad.device), None


def _layer_stats(layers: list[MoE]) -> torch.Tensor:
    """(L, 2E + 2) per layer: tokens routed to each expert (before capacity), router probability
    sums, the sum over tokens of logsumexp(logits)^2, the token count; summed over the layers'
    `token_axes` (`pool_router_stats_over`)."""
    rows = []
    for m in layers:
        p = m.stats["probs_sum"]
        z = torch.logsumexp(_wide(m.stats["logits"]), -1).square().sum()
        rows.append(torch.cat([m.stats["selected"].to(p.dtype), p, z.to(p.dtype).reshape(1),
                               p.new_full((1,), float(m.stats["tokens"]))]))
    stats = torch.stack(rows)
    for axis, scale in getattr(layers[0], "token_axes", ()):
        stats = _PooledSum.apply(stats, axis, scale)
    return stats


def router_loss(module: nn.Module):
    """aux_loss_coef x the switch loss + z_loss_coef x the mean z-loss over the model's MoE
    layers, from the latest forward of `module`'s (0.0 without MoE layers or coefficients); part
    of every loss GPT.forward returns, validation losses included (as transformers' Mixtral adds
    it). In training it also adds each layer's counts to the step's load (`step_load`).

    `aux_loss_scope`: "model" pools f and P over the module's MoE layers (transformers'
    `load_balancing_loss_func`), "layer" sums each layer's own E sum_e f_e P_e (Megatron-Core's
    per-layer loss): a pipeline stage computes its share of it (`carry_router_loss`). The z-loss
    sums the module's layers and divides by the MODEL's MoE layer count (`n_moe_layers`): the
    stages' shares add up to the mean over all layers."""
    layers = [m for m in moe_layers(module) if m.stats is not None]
    if not layers:
        return 0.0
    cfg = layers[0].cfg
    if torch.is_grad_enabled() and module.training:
        for m in layers:
            m._load = m.stats["counts"].double() + getattr(m, "_load", 0.0)
            m._dropped = m.stats["dropped"] + getattr(m, "_dropped", 0)
    if not (cfg.aux_loss_coef or cfg.z_loss_coef):
        return 0.0
    E = cfg.n_experts
    stats = _layer_stats(layers)
    selected, probs, z, tokens = stats[:, :E], stats[:, E:2 * E], stats[:, 2 * E], stats[:, -1]
    loss = 0.0
    if cfg.aux_loss_coef and cfg.aux_loss_scope == "layer":
        per_layer = ((selected / tokens[:, None]) * (probs / tokens[:, None])).sum(1)
        loss = loss + cfg.aux_loss_coef * E * per_layer.sum()
    elif cfg.aux_loss_coef:
        rows = tokens.sum()
        f = selected.sum(0) / rows  # sums to top_k
        loss = loss + cfg.aux_loss_coef * E * (f * (probs.sum(0) / rows)).sum()
    if cfg.z_loss_coef:
        loss = loss + cfg.z_loss_coef * (z / tokens).sum() / n_moe_layers(cfg)
    return loss


@torch.no_grad()
def step_load(module: nn.Module, group=None, token_group=None, stages=None, cfg=None) -> dict:
    """The step's expert load, summed over the model's MoE layers and micro-batches (and over the
    ranks of `group`, the data-parallel ranks; `token_group`, the tp ranks under sequence
    parallelism, each holding part of the tokens; `stages`, the pp ranks, each holding some of
    the layers): tokens per expert (`expert_load`, one count per expert) with its min / max / coefficient of variation, and dropped token-slots.
    Updates the aux-loss-free biases (router_bias_rate) from each layer's own load (summed over
    `group` and `token_group`: equal on every rank holding the layer), then resets the loads. {}
    without MoE layers (in `cfg`, the whole model: a stage without one still joins the sum over
    `stages`)."""
    layers = [m for m in moe_layers(module) if hasattr(m, "_load")]
    cfg = cfg if cfg is not None else (layers[0].cfg if layers else None)
    if cfg is None or not n_moe_layers(cfg):
        return {}
    E = cfg.n_experts
    total = torch.zeros(E + 1, dtype=torch.float64, device=next(module.parameters()).device)
    if layers:
        flat = torch.cat([torch.stack([m._load for m in layers]).flatten(),
                          torch.tensor([float(sum(m._dropped for m in layers))], dtype=torch.float64,
                                       device=layers[0]._load.device)])
        for g in (group, token_group):
            if g is not None and g.size > 1:
                comm.all_reduce(flat, g)
        loads = flat[:-1].view(len(layers), E)
        for m, load in zip(layers, loads):
            if m.cfg.router_bias_rate:  # DeepSeek-V3: raise the under-loaded, lower the over-loaded
                m.expert_bias += m.cfg.router_bias_rate * torch.sign(load.mean() - load).float()
            del m._load, m._dropped
        total = torch.cat([loads.sum(0), flat[-1:]])
    if stages is not None and stages.size > 1:
        comm.all_reduce(total, stages)
    load = total[:-1]
    cv = float(load.std(correction=0) / load.mean()) if load.mean() > 0 else 0.0
    return {"expert_load": [int(n) for n in load.tolist()], "expert_load_min": int(load.min()), "expert_load_max": int(load.max()),
            "expert_load_cv": cv, "dropped_tokens": int(total[-1])}
