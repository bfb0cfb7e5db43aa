"""The step's logged loss averaged over the replicas: one float64 element all-reduced over cp x dp
(`LOSS_BYTES`, 8), which the host-share cost model charges after each step and a measured timeline
shows as the last dp all-reduce of a step."""

from __future__ import annotations

import torch

from mini3d import comm

LOSS_DTYPE = torch.float64  # the loss average is exact to the last bit of a float32 or bf16 run's loss
LOSS_BYTES = torch.empty((), dtype=LOSS_DTYPE).element_size()  # 8: the one element's payload


def mean_over_replicas(loss, axis, device):
    """The mean of `loss` over `axis`'s ranks (cp x dp: every replica's and cp rank's mean loss).

    A float gives a float (a host sync: the value is read back). A tensor (the trainer's step
    loss, still on the device) gives a 0-dim `LOSS_DTYPE` tensor without reading anything, so the
    loop can read the loss, the gradient norm and the stop flag in one sync (mini3d.run.train)."""
    if not isinstance(loss, torch.Tensor):
        return loss if axis.size == 1 else float(mean_over_replicas(
            torch.tensor(loss, dtype=LOSS_DTYPE, device=device), axis, device))
    t = loss.detach().to(device=device, dtype=LOSS_DTYPE).reshape(1)
    if axis.size > 1:
        t = t.clone()  # a copy: the caller's tensor is never all-reduced in place
        comm.all_reduce(t, axis, op="avg")
    return t.reshape(())


__all__ = ["LOSS_DTYPE", "LOSS_BYTES", "mean_over_replicas"]
