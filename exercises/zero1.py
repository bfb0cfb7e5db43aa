"""Exercise zero1: ZeRO stage 1, each data-parallel rank keeps the AdamW state of one shard only.

Chapter: 03 ZeRO (course/03_zero.ipynb)
"""
from __future__ import annotations
import torch
from mini3d import comm

class Zero1AdamW:
    """AdamW whose optimizer state is sharded over the data-parallel `axis`.

    All parameters are viewed as one flat vector, padded to a multiple of axis.size; member i owns
    the i-th equal slice. `step()`: (1) average the flat gradient over the axis; (2) run
    `self.optimizer` (a torch.optim.AdamW over a single flat tensor: this rank's slice) on the
    owned slice; (3) `comm.all_gather` the updated slices and copy them back into the parameters.
    So each rank holds 2 * N / dp optimizer-state floats instead of 2 * N."""

    def __init__(self, params, axis, **adamw_kwargs):
        raise NotImplementedError('see the class docstring')

    def _flat(self, get):
        raise NotImplementedError('torch.cat of flattened tensors, padded to shard * axis.size')

    @torch.no_grad()
    def step(self):
        raise NotImplementedError('average the flat gradient over the axis, step the local shard with self.optimizer, then comm.all_gather the shards back into the parameters')

    def zero_grad(self):
        raise NotImplementedError("set each parameter's .grad to None")
