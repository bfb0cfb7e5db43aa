"""ZeRO-2: gradients sharded too; each micro-batch's buckets reduce-scattered into a persistent shard.

A rank keeps a gradient shard of size padded/dp per bucket. The hook adds each fresh gradient into a
*transient* full-size bucket buffer and drops `p.grad`; a complete bucket is reduce-scattered in
place (into its slice `lo:hi`), and when that completes the slice is *added* into the shard and the
full buffer freed. A bucket's buffer is allocated at its first gradient, after waiting until fewer
than `buckets.GRAD_BUCKETS_IN_FLIGHT` earlier reductions are pending, so at most that many full
buffers are alive at any moment (`buckets.transient_grad_bytes`, what the estimator charges) while
the reductions overlap the backward of the layers that fill the next buckets.

Every micro-batch is reduced, `no_sync()` or not, so no full gradient outlives its bucket's
reduction at any micro-batch count, for micro_batches times the reduce-scatter traffic (why:
zero.py, "Micro-batches under ZeRO-2/3"). The updated parameters come back as in ZeRO-1.
"""

from __future__ import annotations

import torch

from mini3d.dp.buckets import GRAD_BUCKETS_IN_FLIGHT
from mini3d.dp.zero1 import Zero1, reduce_scatter_in_place


class Zero2(Zero1):
    number = 2
    shards = ("optimizer_states", "gradients")
    reduce_op = "reduce_scatter"
    reduces_every_micro_batch = True
    param_gather = "after_step"

    def allocate_grads(self, dp, b, device):
        b.grad_shard = torch.zeros(b.shard_numel, dtype=dp.grad_dtype, device=device)
        dp.meter.hold(("shard", b.index), b.grad_shard)

    def grad_buffer(self, dp, b):
        """The bucket's transient full buffer, allocated (zero) at its first gradient once at most
        GRAD_BUCKETS_IN_FLIGHT - 1 earlier reductions are still pending."""
        if b.grad_buf is None:
            dp.in_flight.drain(GRAD_BUCKETS_IN_FLIGHT - 1)
            b.grad_buf = torch.zeros(b.padded, dtype=dp.grad_dtype, device=b.param_buf.device)
            dp.meter.hold(("buf", b.index), b.grad_buf)
        return b.grad_buf

    def launch(self, dp, b):
        work = reduce_scatter_in_place(b, b.grad_buf, b.axis)

        def finish(b=b):  # add into the shard, free the full-size transient buffer
            b.grad_shard.add_(b.grad_buf[b.lo:b.hi])
            b.grad_buf = None
            dp.meter.release(("buf", b.index))
        return work, finish

    def held_grads(self, b):
        return b.grad_shard

    def grad_shard(self, b):
        return b.grad_shard

    def zero_grads(self, dp, b):
        b.grad_shard.zero_()
        b.grad_buf = None
        dp.meter.release(("buf", b.index))
