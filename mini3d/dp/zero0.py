"""ZeRO-0, plain data parallelism (DDP): nothing sharded, the gradients all-reduced once per step.

Every rank holds the full parameters, gradients and optimizer state. Each bucket's gradient buffer
is persistent and every `p.grad` a view into it, so the micro-batches accumulate in place (under
`no_sync()`) and the `all_reduce(avg)` of a complete bucket leaves the averaged values where the
optimizer reads them: no copy back, nothing to gather after the step.
"""

from __future__ import annotations

from mini3d import comm
from mini3d.dp.ddp import BucketStage


class Zero0(BucketStage):
    number = 0
    shards = ()
    reduce_op = "all_reduce"
    reduces_every_micro_batch = False
    param_gather = "never"

    def launch(self, dp, b):
        return comm.all_reduce(b.grad_buf, b.axis, op="avg", async_op=True), None

    def param_shard(self, b):
        return b.param_buf

    def grad_shard(self, b):
        return b.grad_buf

    def full_grad(self, dp, b):
        return b.grad_buf.clone()
