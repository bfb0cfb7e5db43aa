"""The step's logged loss averaged over the replicas: one float64 element all-reduced over cp x dp
(`LOSS_BYTES`, 8), which the host-share cost model charges after each step and a measured timeline
shows as the last dp all-reduce of a step."""

from __future__ import annotations

import torch

from mini3d import comm

LOSS_DTYPE = torch.float64  # the loss average is exact to the last bit of a float32 or bf16 run's loss
LOSS_BYTES = torch.empty((), dtype=LOSS_DTYPE).element_size()  # 8: the one element's payload


def mean_over_replicas(loss: float, axis, device) -> float:
    """The mean of `loss` over `axis`'s ranks (cp x dp: every replica's and cp rank's mean loss)."""
    if axis.size == 1:
        return loss
    t = torch.tensor([loss], dtype=LOSS_DTYPE, device=device)
    comm.all_reduce(t, axis, op="avg")
    return float(t.item())


__all__ = ["LOSS_DTYPE", "LOSS_BYTES", "mean_over_replicas"]
