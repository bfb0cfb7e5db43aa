"""Validation loss of the parallel model: forward only, every layout, the single-process value.

`evaluate(trainer, batches, k)` averages the mean token loss over validation global batches 0..k-1
(`Batches(..., stream=1)`: a fixed set, so evaluations are comparable across steps and layouts).
Each global batch is split exactly like a training batch (dp replica, micro-batches of equal size,
and with cp > 1 this cp rank's zig-zag chunks of every sequence with their positions,
`mini3d.cp.chunk_micro_batches`), so the mean of the micro-batch means, averaged over cp x dp
(equal token counts), is the global batch's mean token loss; only the summation order differs from
one process (float32 rounding).

Pipelines: every rank walks the (micro-batch, stage) pairs in one global order and acts on the stages
it holds: receive the input from the previous stage's rank, run forward under no_grad, send the
output on. That order is a single chain, so blocking sends and receives cannot deadlock, and it needs
no schedule (the training schedules interleave backward passes, which evaluation does not have).
The loss is then broadcast from the last stage's rank (with router losses, summed over pp with the
headless stages' carried ones, `mini3d.pp.runtime.pp_total_loss`) and averaged over dp.
"""

from __future__ import annotations

import torch

from mini3d.cp import chunk_micro_batches, set_positions
from mini3d.pp.runtime import pp_total_loss


@torch.no_grad()
def evaluate(trainer, batches, n_batches: int) -> float:
    """Mean validation loss over `n_batches` global batches; collective (every rank calls it,
    every rank gets the value)."""
    topo, plan = trainer.topo, trainer.plan
    total = 0.0
    for k in range(n_batches):
        mbs = batches.micro_batches(k, topo.dp.index, plan.dp, plan.micro_batches)
        mbs = chunk_micro_batches(mbs, plan.cp, topo.cp.index)  # as a training step's
        if plan.cp > 1:  # the global positions of this cp rank's tokens
            set_positions(trainer.chunks, mbs[0][2].to(topo.device))
        mbs = [(x.to(topo.device), y.to(topo.device)) for x, y, *_ in mbs]
        if trainer.runtime is None:
            total += float(torch.stack([trainer.net(x, y) for x, y in mbs]).mean())
        else:  # the loss on every pp rank
            loss, carried = _pipeline_forward(trainer, mbs)
            total += float(pp_total_loss(trainer.runtime, loss, carried, len(mbs)))
    return trainer.mean_loss_over_dp(total / n_batches)


def _pipeline_forward(trainer, mbs):
    """This rank's part of a forward-only pass over the pipeline; the loss on the last stage."""
    rt = trainer.runtime
    sched, me = rt.schedule, rt.pp_rank
    last = sched.n_stages - 1
    losses, carried = [], []  # carried: headless stages' router losses (MoE)
    for x, y in mbs:
        h = None
        for s in range(sched.n_stages):
            if sched.rank_of(s) != me:
                continue
            if s > 0:
                prev = sched.rank_of(s - 1)
                h = h if prev == me else rt.p2p.recv(prev)
            out = trainer.stages[s](x if s == 0 else h, y) if s == last else trainer.stages[s](
                x if s == 0 else h)
            if s != last and getattr(trainer.stages[s], "carried_loss", None) is not None:
                carried.append(trainer.stages[s].carried_loss)
                trainer.stages[s].carried_loss = None
            if s == last:
                losses.append(out)
            elif sched.rank_of(s + 1) != me:
                rt.p2p.send(out, sched.rank_of(s + 1))
            h = out
    return (torch.stack(losses).mean() if losses else None), carried


__all__ = ["evaluate"]
