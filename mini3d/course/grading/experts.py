"""Checks of the exercise a2a_volume (chapter 10): the bytes of expert parallelism's all-to-all,
and the dispatch permutation with its inverse.

References: the volume is `mini3d.cost.moe.a2a_bytes` (the one owner of that formula), never a
copy of it; the dispatch order is the one `mini3d.models.moe` uses (a stable sort of the slots by
expert), and every other expectation is counted directly from the drawn routing. Every draw has
top_k >= 2 and ep >= 2, so a token counted once instead of top_k times, or the local 1/ep share
counted as traffic, always changes the answer; the permutation drawn for `undo` is never its own
inverse, so skipping the undo or applying the permutation again always scrambles the rows.
"""

from __future__ import annotations

import torch

from mini3d.cost.moe import a2a_bytes as reference_bytes
from mini3d.course.grading.core import Check, Exercise, expect


def _routing(rng, tokens: int, top_k: int, n_experts: int):
    """(tokens, top_k) int64: top_k distinct experts per token, drawn from the seed."""
    return torch.tensor([rng.sample(range(n_experts), top_k) for _ in range(tokens)], dtype=torch.int64)


def _shape(rng):
    ep = rng.choice([2, 4, 8])
    n_experts = ep * rng.choice([1, 2, 4])
    top_k = rng.randint(2, min(4, n_experts))
    return ep, n_experts, top_k


def _close(got, want) -> bool:
    try:
        return abs(float(got) - float(want)) <= 1e-9 * max(1.0, abs(float(want)))
    except (TypeError, ValueError):
        return False


def volume(ctx):
    for _ in range(3):
        ep, _, top_k = _shape(ctx.rng)
        tokens, d, b = ctx.rng.randint(16, 4096), ctx.rng.choice([64, 512, 4096]), ctx.rng.choice([2, 4])
        got, want = ctx.impl.a2a_bytes(tokens, top_k, ep, d, b), reference_bytes(tokens, d, top_k, ep, b)
        expect(_close(got, want), f"a2a_bytes(tokens={tokens}, top_k={top_k}, ep={ep}, d_model={d}, "
               f"element_bytes={b})", f"{want:,.0f} (mini3d.cost.moe.a2a_bytes)", got)
    got = ctx.impl.a2a_bytes(64, 2, 1, 128, 2)
    expect(_close(got, 0), "a2a_bytes with ep=1 (every expert at home)", 0, got)


def _dispatch(ctx, experts, n_experts: int, ep: int):
    perm, splits = ctx.impl.dispatch(experts, n_experts, ep)
    return torch.as_tensor(perm, dtype=torch.int64).reshape(-1), [int(s) for s in splits]


def dispatch(ctx):
    for _ in range(2):
        ep, n_experts, top_k = _shape(ctx.rng)
        tokens = ctx.rng.randint(6, 24)
        experts = _routing(ctx.rng, tokens, top_k, n_experts)
        perm, splits = _dispatch(ctx, experts, n_experts, ep)
        what = f"dispatch of {tokens} tokens, top_k={top_k}, {n_experts} experts over ep={ep}"
        n = tokens * top_k
        expect(sorted(perm.tolist()) == list(range(n)), f"{what}: perm",
               f"each of the {n} slots exactly once", perm.tolist())
        flat = experts.reshape(-1)
        want = torch.argsort(flat, stable=True)
        expect(torch.equal(perm, want), f"{what}: perm (experts {flat.tolist()})",
               f"{want.tolist()} (by expert, ties in slot order)", perm.tolist())
        per = n_experts // ep
        want_splits = [int((flat // per == r).sum()) for r in range(ep)]
        expect(splits == want_splits, f"{what}: splits (experts {flat.tolist()})", want_splits, splits)


def local_share(ctx):
    """The bytes a rank really sends: its own block stays home, on a random routing and on a
    perfectly balanced one (where they must equal the cost model's volume)."""
    ep, n_experts, top_k = _shape(ctx.rng)
    d, b = ctx.rng.choice([8, 64, 256]), ctx.rng.choice([2, 4])
    tokens = ctx.rng.randint(8, 32)
    experts = _routing(ctx.rng, tokens, top_k, n_experts)
    splits = [int((experts.reshape(-1) // (n_experts // ep) == r).sum()) for r in range(ep)]
    rank = ctx.rng.randrange(ep)
    got = ctx.impl.send_bytes(splits, rank, d, b)
    want = sum(s for r, s in enumerate(splits) if r != rank) * d * b
    expect(_close(got, want), f"send_bytes(splits={splits}, rank={rank}, d_model={d}, element_bytes={b})",
           want, got)
    tokens = n_experts * ctx.rng.randint(1, 4)  # slot s to expert s % E: every expert equally often
    balanced = (torch.arange(tokens * top_k) % n_experts).reshape(tokens, top_k)
    _, splits = _dispatch(ctx, balanced, n_experts, ep)
    got, want = ctx.impl.send_bytes(splits, rank, d, b), reference_bytes(tokens, d, top_k, ep, b)
    expect(_close(got, want), f"send_bytes of your dispatch's splits {splits} for a balanced routing "
           f"({tokens} tokens, top_k={top_k}, ep={ep}, rank {rank})",
           f"{want:,.0f}, mini3d.cost.moe.a2a_bytes", got)


def undo(ctx):
    for _ in range(2):
        ep, n_experts, top_k = _shape(ctx.rng)
        while True:  # a permutation that is not its own inverse
            tokens = ctx.rng.randint(6, 16)
            perm = torch.argsort(_routing(ctx.rng, tokens, top_k, n_experts).reshape(-1), stable=True)
            if not torch.equal(perm[perm], torch.arange(len(perm))):
                break
        g = torch.Generator().manual_seed(ctx.rng.randrange(2**31))
        rows = torch.randn(len(perm), ctx.rng.choice([2, 4]), generator=g)
        got = ctx.impl.undo(rows[perm], perm)
        ok = isinstance(got, torch.Tensor) and got.shape == rows.shape and torch.equal(got, rows)
        expect(ok, f"undo(rows in dispatch order, perm={perm.tolist()})",
               "the rows back in slot order (row i of the input to position perm[i])",
               "rows in another order" if isinstance(got, torch.Tensor) and got.shape == rows.shape
               else repr(getattr(got, "shape", type(got))))


EXERCISES = [
    Exercise("a2a_volume", "10 mixture of experts", [
        Check("volume", 3, volume, "bytes per all-to-all under balanced routing (mini3d.cost.moe)"),
        Check("dispatch", 3, dispatch, "slots sorted by expert, and the split sizes per rank"),
        Check("local_share", 2, local_share, "a rank's own block is not traffic"),
        Check("undo", 3, undo, "the combined rows put back in slot order"),
    ]),
]

__all__ = ["EXERCISES"]
