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
        raise NotImplementedError('see the class docstring')

    def _flat(self, get):
        raise NotImplementedError('torch.cat of flattened tensors, padded to shard * axis.size')

    @torch.no_grad()
    def step(self):
        raise NotImplementedError('each rank updates only its own slice: which collective hands every rank the average of just that slice? Step it, then share the updated slices with the others')

    def zero_grad(self):
        raise NotImplementedError("set each parameter's .grad to None")
