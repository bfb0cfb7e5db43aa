"""Checks of the exercise lse_merge (chapter 07b): one attention block with its log-sum-exp, and
the rule that combines blocks (what mini3d.cp's ring attention does as K/V blocks arrive).

References are torch's own: `F.scaled_dot_product_attention` over all the keys at once, and
`torch.logsumexp` of the scores. Shapes and values are drawn from the grading seed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mini3d.course.grading.core import Check, Exercise, expect

TOL = 1e-5  # float32, O(1) values: other summation orders agree to ~1e-6
EPS = torch.finfo(torch.float32).eps


def _score_tol(q, k, v) -> float:
    """TOL plus the rounding that scores of size S carry: a float32 score is exact only to eps * S,
    so each weight exp(score - lse) is off by up to ~eps * S relatively, and the output (a weighted
    mean of v) by eps * S * max|v|. Measured over 2,000 draws with scores in the thousands: at most
    0.32 of that; the tolerance allows twice it. An overflowing merge gives inf / nan, far outside."""
    s = float((q @ k.transpose(-2, -1)).abs().max()) / math.sqrt(q.shape[-1])
    return TOL + 2 * EPS * s * float(v.abs().max())


def _qkv(rng, tq: int, tk: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    b, h, d = rng.randint(1, 3), rng.randint(1, 3), rng.choice([4, 8])
    return (torch.randn(b, h, tq, d, generator=g) * scale, torch.randn(b, h, tk, d, generator=g),
            torch.randn(b, h, tk, d, generator=g))


def _close(got, want, tol: float = TOL) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= tol)


def _err(got, want) -> str:
    if not isinstance(got, torch.Tensor):
        return repr(type(got))
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}"
    return f"max error {float((got - want).abs().max()):.3g}"


def block_lse(ctx):
    for causal in (False, True):
        t = ctx.rng.randint(3, 9)
        q, k, v = _qkv(ctx.rng, t, t)
        out, lse = ctx.impl.block_attention(q, k, v, causal)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        expect(_close(out, want), f"block_attention out (T={t}, causal={causal})",
               "torch's scaled_dot_product_attention", _err(out, want))
        expect(_close(lse, torch.logsumexp(s, -1)), f"block_attention lse (T={t}, causal={causal})",
               "torch.logsumexp of the (masked) scores", _err(lse, torch.logsumexp(s, -1)))


def _two_blocks(ctx, scale: float, what: str):
    tq, tk = ctx.rng.randint(2, 6), ctx.rng.randint(4, 12)
    cut = ctx.rng.randint(1, tk - 1)
    q, k, v = _qkv(ctx.rng, tq, tk, scale)
    a = ctx.impl.block_attention(q, k[..., :cut, :], v[..., :cut, :], False)
    b = ctx.impl.block_attention(q, k[..., cut:, :], v[..., cut:, :], False)
    out, lse = ctx.impl.merge(*a, *b)
    want, tol = F.scaled_dot_product_attention(q, k, v), _score_tol(q, k, v)
    expect(_close(out, want, tol), f"merge of keys [0:{cut}] and [{cut}:{tk}] ({what})",
           f"attention over all the keys at once (within {tol:.2g})", _err(out, want))


def merge_two(ctx):
    for _ in range(2):
        _two_blocks(ctx, 1.0, "ordinary scores")


def stable(ctx):
    _two_blocks(ctx, 400.0, "scores in the thousands")


def ring_order(ctx):
    """Causal attention of a sequence cut into n chunks: query chunk i merges key chunks 0..i-1
    (fully visible) and its own (causal), in the random order a ring would deliver them."""
    n, c = ctx.rng.randint(2, 4), ctx.rng.randint(2, 4)
    q, k, v = _qkv(ctx.rng, n * c, n * c)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for i in range(n):
        qi = q[..., i * c:(i + 1) * c, :]
        order = list(range(i + 1))
        ctx.rng.shuffle(order)
        acc = None
        for j in order:
            part = ctx.impl.block_attention(qi, k[..., j * c:(j + 1) * c, :],
                                            v[..., j * c:(j + 1) * c, :], j == i)
            acc = part if acc is None else ctx.impl.merge(*acc, *part)
        expect(_close(acc[0], want[..., i * c:(i + 1) * c, :]),
               f"query chunk {i} of {n}, key chunks merged in the order {order}",
               "the rows of causal attention over the whole sequence",
               _err(acc[0], want[..., i * c:(i + 1) * c, :]))


EXERCISES = [
    Exercise("lse_merge", "07b long sequences", [
        Check("block_lse", 3, block_lse, "one block's output and log-sum-exp, causal or not"),
        Check("merge_two", 3, merge_two, "two blocks merge into attention over all keys"),
        Check("stable", 2, stable, "the merge stays finite for huge scores"),
        Check("ring_order", 3, ring_order, "causal chunks merged in any order"),
    ]),
]

__all__ = ["EXERCISES"]
