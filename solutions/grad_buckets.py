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
        self.axis = axis
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in reversed([p for p in model.parameters() if p.requires_grad]):
            b = p.numel() * p.element_size()
            if not self.buckets or size + b > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += b
        self.bucket_of = {id(p): k for k, ps in enumerate(self.buckets) for p in ps}
        self.ready = [0] * len(self.buckets)
        self.pending: list = []
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p):
        k = self.bucket_of[id(p)]
        self.ready[k] += 1
        if self.ready[k] == len(self.buckets[k]):
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[k]])
            self.pending.append((k, flat, comm.all_reduce(flat, self.axis, async_op=True)))

    def finish(self):
        for k, flat, work in self.pending:
            work.wait()
            flat.div_(self.axis.size)
            offset = 0
            for q in self.buckets[k]:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
