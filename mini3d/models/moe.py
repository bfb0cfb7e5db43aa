"""A mixture-of-experts MLP: router, top-k dispatch, stacked experts.

`MoE` takes the place of a block's dense MLP (`blocks.{i}.mlp`) in the layers
`ModelConfig.is_moe_layer` names. For N tokens x (N, d):

    logits = router(x)                          (N, E)   a bias-free Linear d -> E
    weights, experts = ROUTERS[cfg.router](...)  (N, k)   which k experts each token uses, and how much
    y[t] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t])   (+ shared(x) with shared experts)

Experts are stacked on dim 0 (`experts.w_gate`, `w_up` (E, F, d), `w_down` (E, d, F)); the tokens
of each expert are contiguous after a stable sort, and their matmuls run as one grouped GEMM
(`torch._grouped_mm`) where this torch supports the dtype and shapes, a loop over experts
otherwise: the same numbers (tests/test_moe.py).

Capacity (`capacity_factor` C > 0): expert e takes at most ceil(C * N * k / E) of its assignments,
those with the largest router weights (Megatron's "probs" drop policy); the rest are dropped (the
token keeps its other experts and the residual). C = 0 is dropless. Under expert parallelism
(mini3d.ep) each rank applies it to its own tokens (N is the rank's), as the one-process run does
to each micro-batch.

Routers: `mini3d.models.routers`. Losses and the load report: `mini3d.models.balance`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from mini3d.models.config import ModelConfig
from mini3d.models.routers import per_sequence, router_for


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
    # no rows at all: an empty product that stays in the graph (x[:0] @ w[0]^T), so the backward
    # still runs through this rank's experts and reaches the all-to-alls around them, as on the
    # ranks that did get rows (a tensor made of nothing would cut the graph, and under expert
    # parallelism this rank would skip the combine's backward exchange: a deadlock)
    return torch.cat(parts) if parts else x[:0] @ w[0].T


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
        self.dispatch = None  # mini3d.ep's ExpertDispatch / mini3d.tp.experts' TPExperts run them
        self.shared_by_sequence = False  # shared(x (B, T, d)), not shared(flat): mini3d.tp.experts

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
            # a shared expert split over tp under sequence parallelism gathers the sequence dim
            y = y + (self.shared(x).reshape(N, d) if self.shared_by_sequence else self.shared(flat))
        seqs = per_sequence(experts, probs, B) if self.cfg.seq_aux_loss_coef else None
        self.stats = {"logits": logits, "probs_sum": probs.sum(0), "selected": selected,
                      "counts": counts.detach(), "dropped": N * k - len(e), "tokens": N,
                      "sequences": seqs}
        return y.view(B, T, d)


