"""Deferred weight gradients: the linear layers' half of a split backward (zero-bubble schedules).

A zero-bubble schedule (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") runs each
micro-batch's backward in two passes: B, the gradient of the stage input, which the upstream stage
is waiting for, and W, the weight gradients, placed where the pipeline would otherwise idle. For a
linear layer y = x W^T + b the two halves are separate matmuls: B needs dx = dy W, W needs
dW = dy^T x and db = sum(dy).

So every linear layer of mini3d (`Linear`, and the tensor-parallel layers, through `linear`) runs
as a small autograd Function while its forward is recorded under `deferring(store)`. Its backward
computes dx and, while the store is open (`store.collecting()`, the B pass), hands (x, dy) to the
store instead of computing dW and db; `store.take()` computes them later (the W pass). Outside
`deferring` (every non-split schedule), `linear` is plain F.linear and costs nothing extra; inside
a torch.compile region too (the Function's side effect cannot be traced into a graph; a compiled
block then computes its weight gradients in B: correct, just not split).

Why by hand: `torch.distributed.pipelining` splits the backward by analysing the autograd graph
and restarting autograd once per weight group for W; on a CPU stage that costs about 1.5x a
whole backward (measured, benchmarks/pp_bubble.py), because every restart walks the graph again.
Megatron-LM's zero-bubble implementation stores (x, dy) per linear layer, as here: B + W then
costs what one backward costs. The parameters outside linear layers (norms, embeddings) are cheap
and take their gradients in B (see `mini3d.pp.split_backward`); so do a MoE layer's router and
routed experts (mini3d.models.moe: the grouped expert matmuls are not deferred, a documented
fallback: correct, their weight half just not moved to W; the shared experts' linears are).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

_STORE = None  # the WeightGradStore of the forward being recorded (None: plain F.linear)


class WeightGradStore:
    """The weight-gradient work B handed over, one (weight, bias, x, dy) per linear call."""

    def __init__(self):
        self.open = False
        self.items = []

    @contextlib.contextmanager
    def collecting(self):
        """While open, deferrable linears' backward stores (x, dy) instead of computing dW, db."""
        self.open = True
        try:
            yield self
        finally:
            self.open = False

    def take(self) -> list:
        """[(parameter, gradient)] of everything stored (dW, and db where a bias needs one);
        the stored tensors are released."""
        out = []
        for weight, bias, x, dy in self.items:
            dw, db = weight_grads(x, dy, weight.requires_grad, bias is not None and bias.requires_grad)
            if dw is not None:
                out.append((weight, dw))
            if db is not None:
                out.append((bias, db))
        self.items = []
        return out


@contextlib.contextmanager
def deferring(store: WeightGradStore | None):
    """Record the forward (or a recomputation of it) with deferrable linear layers."""
    global _STORE
    before, _STORE = _STORE, store
    try:
        yield
    finally:
        _STORE = before


def weight_grads(x, dy, want_w: bool = True, want_b: bool = False):
    """(dW, db) of y = x W^T + b from its input x (..., in) and output gradient dy (..., out)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw = dy2.t().mm(x.reshape(-1, x.shape[-1])) if want_w else None
    db = dy2.sum(0) if want_b else None
    return dw, db


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.store = store
        # the parameters themselves, for W to accumulate into: a saved tensor may come back as
        # another object (a recomputed forward's detached copy, under activation checkpointing)
        ctx.params = (weight, bias)
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.store.open:  # B: the weight half waits in the store for W
            ctx.store.items.append((*ctx.params, x, dy))
            return dx, None, None, None
        dw, db = weight_grads(x, dy, ctx.needs_input_grad[1],
                              bias is not None and ctx.needs_input_grad[2])
        return dx, dw, db, None


def linear(x, weight, bias=None):
    """F.linear, whose weight gradients can be deferred (see the module docstring)."""
    if torch.compiler.is_compiling() or _STORE is None:
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias, _STORE)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict keys) through `linear`."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


__all__ = ["WeightGradStore", "deferring", "weight_grads", "linear", "Linear"]
