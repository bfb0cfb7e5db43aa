"""Exercise a2a_volume: expert parallelism's all-to-all, its bytes, and the permutation it needs.

Chapter: 10 mixture of experts (course/10_mixture_of_experts.ipynb)

Reference answer. mini3d.cost.moe.a2a_bytes is the balanced-routing volume the cost model uses;
mini3d.models.moe sorts a layer's token-slots by expert the same way (a stable argsort).
"""
from __future__ import annotations

import torch


def a2a_bytes(tokens: int, top_k: int, ep: int, d_model: int, element_bytes: int) -> float:
    # every token is top_k token-slots; a slot's expert is on another rank (ep - 1) / ep of the time
    return tokens * top_k * (ep - 1) / ep * d_model * element_bytes


def dispatch(experts, n_experts: int, ep: int):
    flat = experts.reshape(-1)  # slot t * k + j: token t's j-th expert
    perm = torch.argsort(flat, stable=True)  # by expert: each rank's experts are contiguous
    splits = torch.bincount(flat // (n_experts // ep), minlength=ep).tolist()
    return perm, splits


def send_bytes(splits, rank: int, d_model: int, element_bytes: int) -> int:
    return (sum(splits) - splits[rank]) * d_model * element_bytes  # the own share stays home


def undo(rows, perm):
    out = torch.empty_like(rows)
    out[perm] = rows  # row i of the dispatch order is slot perm[i]
    return out
