"""Exercise zero1: ZeRO stage 1, each data-parallel rank keeps the AdamW state of one shard only.

Chapter: 03 ZeRO (course/03_zero.ipynb)
"""

from __future__ import annotations

import torch

from mini3d import comm


class Zero1AdamW:
    """AdamW whose optimizer state is sharded over the data-parallel `axis`.

    All parameters are viewed as one flat vector, padded to a multiple of axis.size; member i owns
    the i-th equal slice. `step()`: (1) `comm.reduce_scatter` the flat gradient (averaged) so that
    each rank receives only the average of the slice it owns; (2) run `self.optimizer` (a
    torch.optim.AdamW over a single flat tensor: this rank's slice) on the owned slice; (3)
    `comm.all_gather` the updated slices and copy them back into the parameters. So each rank holds
    2 * N / dp optimizer-state floats instead of 2 * N, and sends 2 psi per step (psi: the flat
    gradient's bytes), as plain data parallelism does; an all-reduce would make it 3 psi."""

    def __init__(self, params, axis, **adamw_kwargs):
        self.params = [p for p in params]
        self.axis = axis
        n = sum(p.numel() for p in self.params)
        self.shard = -(-n // axis.size)
        flat = self._flat(lambda p: p.detach())
        self.local = flat[axis.index * self.shard:(axis.index + 1) * self.shard].clone()
        self.local.requires_grad_(True)
        self.optimizer = torch.optim.AdamW([self.local], **adamw_kwargs)

    def _flat(self, get):
        flat = torch.cat([get(p).reshape(-1) for p in self.params])
        return torch.nn.functional.pad(flat, (0, self.shard * self.axis.size - flat.numel()))

    @torch.no_grad()
    def step(self):
        grad = self._flat(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
        self.local.grad = torch.empty(self.shard, dtype=grad.dtype)
        comm.reduce_scatter(self.local.grad, grad, self.axis, op="avg")
        self.optimizer.step()
        full = torch.empty(self.shard * self.axis.size, dtype=self.local.dtype)
        comm.all_gather(full, self.local.detach(), self.axis)
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self):
        for p in self.params:
            p.grad = None
