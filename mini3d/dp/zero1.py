"""ZeRO-1 (the ZeRO paper's P_os): optimizer states sharded, gradients reduce-scattered once per step.

The full gradient buffer of each bucket is kept (p.grad views, accumulating the micro-batches in
place as ZeRO-0 does), but a complete bucket is `reduce_scatter(avg)`-ed in place: only this rank's
shard `lo:hi` receives the averaged gradient (the rest of the buffer is left undefined), which is all
its optimizer shard needs. After the step every rank all-gathers the updated parameter shards:
reduce-scatter + all-gather = the wire volume of one all-reduce (2 Psi, `cost.comm_time`).
"""

from __future__ import annotations

from mini3d import comm
from mini3d.dp.ddp import BucketStage


def reduce_scatter_in_place(b, buf, axis):
    """Async `reduce_scatter(avg)` of the full bucket buffer `buf` into its own slice `lo:hi`
    (NCCL allows recvbuff == sendbuff + rank * recvcount; gloo copies): no output buffer."""
    return comm.reduce_scatter(buf[b.lo:b.hi], buf, axis, op="avg", async_op=True)


class Zero1(BucketStage):
    number = 1
    shards = ("optimizer_states",)
    reduce_op = "reduce_scatter"
    reduces_every_micro_batch = False
    param_gather = "after_step"

    def launch(self, dp, b):
        return reduce_scatter_in_place(b, b.grad_buf, b.axis), None

    def gather_params(self, dp):
        """All-gather every bucket's updated parameter shard (all issued, then all waited)."""
        for w in [comm.all_gather(b.param_buf, b.param_buf[b.lo:b.hi].clone(), b.axis,
                                  async_op=True) for b in dp.buckets]:
            w.wait()
