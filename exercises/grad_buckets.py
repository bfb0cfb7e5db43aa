"""Exercise grad_buckets: data-parallel gradient averaging in buckets, started during backward.

Chapter: 02 data parallelism (course/02_data_parallelism.ipynb)
"""
from __future__ import annotations
import torch
from mini3d import comm

class BucketedGradSync:
    """Average every parameter's gradient over the data-parallel `axis`, bucket by bucket.

    Buckets: walk `list(model.parameters())` in reverse (gradients become ready roughly in that
    order); start a new bucket when adding the next parameter would exceed `bucket_bytes` (a
    parameter larger than that gets a bucket of its own). When the last gradient of a bucket has been
    accumulated (use `register_post_accumulate_grad_hook`), flatten the bucket's gradients and start
    an asynchronous `comm.all_reduce` right away, during backward. `finish()`, called after
    backward, waits for every bucket, divides by axis.size and copies the averages back into .grad."""

    def __init__(self, model: torch.nn.Module, axis, bucket_bytes: int):
        raise NotImplementedError('see the class docstring')

    def _on_grad(self, p):
        raise NotImplementedError('count ready gradients per bucket; when a bucket is complete, torch.cat its grads and start comm.all_reduce(..., async_op=True)')

    def finish(self):
        raise NotImplementedError('wait for each pending all-reduce, divide by axis.size, copy slices back into each .grad')
