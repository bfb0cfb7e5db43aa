"""The routers of a MoE layer (mini3d.models.moe): which k experts each token uses, and how much.

Routers (`--router`): `softmax` keeps the top-k of the softmax (Qwen3-MoE with norm_topk_prob
off), `softmax-norm` renormalises those k to sum to one (Mixtral, whose softmax over the top-k
logits is the same thing, and Qwen3-MoE), `sigmoid` picks the top-k of sigmoid scores plus a
per-expert bias and weights by the renormalised scores (DeepSeek-V3's aux-loss-free balancing: the
bias, a float32 buffer outside the optimizer, moves by `router_bias_rate` towards the under-loaded
experts after each step, `update_expert_bias`).
"""

from __future__ import annotations

import torch

from mini3d.models.config import ModelConfig


def widened(t: torch.Tensor) -> torch.Tensor:
    """float32 at least (bf16 logits widened; a float64 run's stay float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class SoftmaxRouter:
    """Top-k of softmax(logits); `norm`: the k weights renormalised to sum to one."""

    def __init__(self, norm: bool):
        self.norm = norm

    def probs(self, logits):
        """(N, E) float32 probabilities the balancing loss reads."""
        return torch.softmax(widened(logits), dim=-1)

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
        s = torch.sigmoid(widened(logits))
        return s / s.sum(dim=-1, keepdim=True)

    def route(self, logits, k: int, bias):
        scores = torch.sigmoid(widened(logits))
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
        scores = torch.sigmoid(widened(logits))
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
