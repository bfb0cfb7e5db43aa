"""Exercise grad_norm: the global gradient norm of a model cut into tp x pp x dp pieces.

Chapter: 06 3D parallelism (course/06_3d_parallelism.ipynb)

Clipping by global norm (`torch.nn.utils.clip_grad_norm_`) needs the norm of the WHOLE model's
gradient, but after the data-parallel sync no rank holds it: each holds pieces, and some pieces
are held by several ranks. Count every element of the full gradient exactly once.
"""
from __future__ import annotations


def global_grad_norm(pieces: list[dict], zero: int) -> float:
    """L2 norm of the full gradient, from every rank's local pieces.

    Each piece is {"pp": stage, "dp": dp rank, "tp": tp rank, "grad": tensor, "tp_sharded": bool}:
    - pipeline stages hold different parameters;
    - a tp-sharded piece is this tp rank's slice of its parameter (the slices are disjoint); a
      replicated one (LayerNorm weights, biases...) is the same tensor on every tp rank;
    - with zero == 0 every dp rank holds the same (already averaged) gradient; with zero >= 1
      each dp rank holds a disjoint shard of it."""
    raise NotImplementedError("sum the squares of each piece that is not a copy of another piece: which dp ranks and which tp ranks hold copies?")


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor clip_grad_norm_ multiplies every gradient by: max_norm / (norm + 1e-6), but never
    more than 1 (gradients are only ever scaled down)."""
    raise NotImplementedError("the docstring gives the ratio; remember clipping only ever scales down")
