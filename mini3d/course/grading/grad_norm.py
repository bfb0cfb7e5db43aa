"""Checks of the exercise grad_norm (chapter 06): the global gradient norm over tp x pp x dp pieces.

Each check builds a random model of float64 gradients, cuts it as mini3d's trainer holds it after
the dp sync (pipeline stages, tp slices or replicated copies, dp replicas or ZeRO shards) and
compares the learner's norm with torch's norm of the uncut gradients. Each check varies one axis,
so an answer that miscounts one kind of copy loses exactly that check.
"""

from __future__ import annotations

import torch

from mini3d.course.grading.core import Check, Exercise, expect


def _model(rng, tp: int, pp: int) -> list[dict]:
    """Random parameters: a stage each, tp-sharded (rows split over tp) or replicated."""
    params = []
    for i in range(rng.randint(3, 6) + pp):
        sharded = i % 3 != 1  # at least one of each kind
        rows = tp * rng.randint(1, 4) if sharded else rng.randint(1, 5)
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        params.append({"stage": i % pp, "sharded": sharded,
                       "grad": torch.randn(rows, rng.randint(1, 6), generator=g, dtype=torch.float64)})
    return params


def _pieces(params: list[dict], tp: int, dp: int, zero: int) -> list[dict]:
    out = []
    for prm in params:
        for t in range(tp):
            local = prm["grad"].chunk(tp, dim=0)[t] if prm["sharded"] else prm["grad"]
            for d in range(dp):
                piece = local if zero == 0 else local.flatten().tensor_split(dp)[d]
                out.append({"pp": prm["stage"], "dp": d, "tp": t, "grad": piece.clone(),
                            "tp_sharded": prm["sharded"]})
    return out


def _check(ctx, tp: int, pp: int, dp: int, zero: int):
    params = _model(ctx.rng, tp, pp)
    truth = float(torch.linalg.vector_norm(torch.cat([p["grad"].flatten() for p in params])))
    pieces = _pieces(params, tp, dp, zero)
    ctx.rng.shuffle(pieces)
    got = ctx.impl.global_grad_norm(pieces, zero)
    expect(isinstance(got, (int, float)) and abs(got - truth) <= 1e-9 * truth,
           f"global_grad_norm with tp={tp} pp={pp} dp={dp} zero={zero} ({len(pieces)} pieces)",
           f"{truth:.12g} (torch's norm of the uncut gradients)", got)


def pipeline_stages(ctx):
    for _ in range(2):
        _check(ctx, 1, ctx.rng.randint(2, 4), 1, 0)


def replicated_once(ctx):
    for _ in range(2):
        _check(ctx, ctx.rng.randint(2, 4), 1, 1, 0)


def dp_copies_and_shards(ctx):
    for zero in (0, ctx.rng.randint(1, 3)):
        _check(ctx, 1, 1, ctx.rng.randint(2, 4), zero)


def clip(ctx):
    for norm, max_norm in ((ctx.rng.uniform(2, 9), 1.0), (0.25, 1.0), (ctx.rng.uniform(0.1, 5), 0.5)):
        want = min(1.0, max_norm / (norm + 1e-6))
        got = ctx.impl.clip_coefficient(norm, max_norm)
        expect(isinstance(got, (int, float)) and abs(got - want) <= 1e-12,
               f"clip_coefficient({norm:.4g}, {max_norm})", want, got)


EXERCISES = [
    Exercise("grad_norm", "06 3D parallelism", [
        Check("pipeline_stages", 2, pipeline_stages, "stages hold different parameters: sum them"),
        Check("replicated_once", 2, replicated_once, "tp slices summed, replicated copies once"),
        Check("dp_copies_and_shards", 2, dp_copies_and_shards, "ZeRO-0 replicas once, ZeRO shards summed"),
        Check("clip", 1, clip, "torch's clipping coefficient"),
    ]),
]

__all__ = ["EXERCISES"]
