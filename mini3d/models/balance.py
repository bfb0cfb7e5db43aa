"""The load-balancing losses of the MoE layers and the per-step expert load.

Losses (`router_loss`, added to the model's loss by `GPT.forward`): the switch-style
load-balancing loss E * sum_e f_e P_e, with f_e the fraction of token-slots routed to e and P_e
the mean router probability of e, both pooled over every MoE layer of the module as
transformers' `load_balancing_loss_func` pools them (`aux_loss_scope` "model"), or each layer's
own loss summed over the layers as Megatron-Core adds them ("layer", what a pipeline stage can
compute for its layers); the z-loss mean_t logsumexp(logits_t)^2 (ST-MoE), averaged over the
model's MoE layers; and DeepSeek-V3's sequence-wise balance loss (`sequence_aux_loss`). Under
the splits (`pool_router_stats_over`, `carry_router_loss`) these equal the one-process losses
(tests/test_moe_splits.py). The per-step load (tokens each expert
processed, summed over layers and micro-batches, all-reduced over the data-parallel ranks, the
tp ranks under sequence parallelism and the pipeline stages) is what `--log-jsonl` reports:
`expert_load` (one count per expert) and its min / max / coefficient of variation.

Pooling (`pool_router_stats_over`): the losses are not sums over tokens (the balancing loss
multiplies two token means), so a rank holding part of a micro-batch's tokens (sequence or context
parallelism) cannot compute its share alone: each layer's per-expert counts, probability sums,
squared-logsumexp sum and token count are summed over those ranks first (one all-reduce per axis
per forward, no communication in backward), and every rank of the group then holds the whole
micro-batch's loss. Its gradient reaches each rank's own tokens; what follows makes the sum over
the group the one-process gradient: under sequence parallelism (tp, scale 1) the trainer sums the
replicated parameters' gradients over tp (`mini3d.tp.sum_replicated_grads`), as for the norms;
under context parallelism (cp, scale cp) the gradients are averaged over cp x dp like replicas',
so each cp rank's part is scaled by cp to undo the 1/cp.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mini3d import comm
from mini3d.models.config import ModelConfig
from mini3d.models.moe import MoE
from mini3d.models.routers import widened


def moe_layers(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def n_moe_layers(cfg: ModelConfig) -> int:
    """MoE layers of the whole model (a pipeline stage holds some of them)."""
    return sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))


def has_router_loss(cfg: ModelConfig) -> bool:
    """Does the model's loss hold router losses (a MoE layer and a non-zero coefficient)?"""
    return n_moe_layers(cfg) > 0 and bool(cfg.aux_loss_coef or cfg.z_loss_coef
                                          or cfg.seq_aux_loss_coef)


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
    hold one micro-batch's tokens: `axes`, [(axis, gradient scale)] (the module docstring's
    "Pooling")."""
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
        z = torch.logsumexp(widened(m.stats["logits"]), -1).square().sum()
        rows.append(torch.cat([m.stats["selected"].to(p.dtype), p, z.to(p.dtype).reshape(1),
                               p.new_full((1,), float(m.stats["tokens"]))]))
    stats = torch.stack(rows)
    for axis, scale in getattr(layers[0], "token_axes", ()):
        stats = _PooledSum.apply(stats, axis, scale)
    return stats


def router_loss(module: nn.Module):
    """aux_loss_coef x the switch loss + z_loss_coef x the mean z-loss over the model's MoE
    layers + seq_aux_loss_coef x `sequence_aux_loss`, from the latest forward of `module`'s (0.0
    without MoE layers or coefficients); part of every loss GPT.forward returns, validation
    losses included (as transformers' Mixtral adds it). In training it also adds each layer's
    counts to the step's load (`step_load`).

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
    loss = 0.0
    if cfg.seq_aux_loss_coef:
        loss = cfg.seq_aux_loss_coef * sequence_aux_loss(layers)
    if not (cfg.aux_loss_coef or cfg.z_loss_coef):
        return loss
    E = cfg.n_experts
    stats = _layer_stats(layers)
    selected, probs, z, tokens = stats[:, :E], stats[:, E:2 * E], stats[:, 2 * E], stats[:, -1]
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


def sequence_aux_loss(layers: list[MoE]):
    """DeepSeek-V3's complementary sequence-wise balance loss (arXiv 2412.19437, eq. 17-20),
    without its alpha (`router_loss` multiplies by seq_aux_loss_coef): for each MoE layer and each
    sequence of T tokens, sum_e f_e P_e with f_e = E / (k T) x the token-slots routed to e and
    P_e = the mean over the sequence's tokens of s'_e = s_e / sum_j s_j (the sigmoid scores,
    normalised, without the bias); averaged over the micro-batch's sequences and summed over the
    layers (a pipeline stage computes its layers' share, like aux_loss_scope "layer"). Routed:
    the router's choice (bias and groups included, before capacity), as DeepSeek's training code
    and Megatron-Core's seq_aux_loss count it; the paper's indicator is the top-k of s alone,
    the same choice without a bias and route groups. Each sequence's rows
    (`mini3d.models.routers.per_sequence`) are sums over its tokens, pooled over the ranks
    holding parts of it (sequence and context parallelism: `pool_router_stats_over`, as the
    other losses) before the products, so every split equals the one-process loss."""
    E, k = layers[0].cfg.n_experts, layers[0].cfg.top_k
    stats = torch.stack([m.stats["sequences"] for m in layers])  # (L, B, 2E + 1)
    for axis, scale in getattr(layers[0], "token_axes", ()):
        stats = _PooledSum.apply(stats, axis, scale)
    chosen, probs, tokens = stats[..., :E], stats[..., E:2 * E], stats[..., -1:]
    f, P = chosen * (E / k) / tokens, probs / tokens
    return (f * P).sum(-1).mean(-1).sum()


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
