"""Exercise grad_norm: the global gradient norm of a model cut into tp x pp x dp pieces.

Chapter: 06 3D parallelism (course/06_3d_parallelism.ipynb)

Reference answer. mini3d's trainer does the same with collectives (`mini3d.tp.clip_grad_norm_`):
one tp all-reduce of [replicated, sharded] sums, one dp all-reduce under ZeRO >= 1, one over pp.
"""
from __future__ import annotations


def global_grad_norm(pieces: list[dict], zero: int) -> float:
    total = 0.0
    for p in pieces:
        if zero == 0 and p["dp"] != 0:
            continue  # a dp replica: the same gradient as dp rank 0's
        if not p["tp_sharded"] and p["tp"] != 0:
            continue  # a replicated parameter: the same tensor as tp rank 0's
        total += float(p["grad"].double().square().sum())
    return total ** 0.5


def clip_coefficient(norm: float, max_norm: float) -> float:
    return min(1.0, max_norm / (norm + 1e-6))
