"""Wrong answers to the distributed exercises: ring_allreduce, grad_buckets (02), zero1 (03),
tp_linear and vocab_ce (04). Each one fails alike on every rank (no deadlock, no gloo abort), so
many can share one launch (see batch.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mini3d import comm
from solutions import grad_buckets as _gb
from solutions import tp_linear as _tp
from solutions import vocab_ce as _ce
from solutions import zero1 as _z1
from solutions.ring_allreduce import ring_all_reduce as _ring

from . import variant


def ring_library(tensor, axis, average=False):
    """comm.all_reduce itself: right numbers, no ring."""
    comm.all_reduce(tensor, axis, op="avg" if average else "sum")
    return tensor


def ring_whole_tensor(tensor, axis, average=False):
    """Pass whole tensors around the ring (n-1 steps): the sum, at (n-1) x the bytes of a chunked ring."""
    n, acc, cur = axis.size, tensor.clone(), tensor.clone()
    for _ in range(n - 1):
        got = torch.empty_like(cur)
        work = comm.send(cur, axis, axis.peer(1), async_op=True)
        comm.recv(got, axis, axis.peer(-1))
        work.wait()
        acc += got
        cur = got
    tensor.copy_(acc / n if average else acc)
    return tensor


class BucketsNoDivide(_gb.BucketedGradSync):
    """Sums the gradients over dp and forgets to divide by axis.size."""

    def finish(self):
        for k, flat, work in self.pending:
            work.wait()
            offset = 0
            for q in self.buckets[k]:
                q.grad.copy_(flat[offset:offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)


class BucketsAtTheEnd(_gb.BucketedGradSync):
    """Reduces every bucket in finish(), after backward: right values, no overlap."""

    def _on_grad(self, p):
        pass

    def finish(self):
        for k, bucket in enumerate(self.buckets):
            flat = torch.cat([q.grad.reshape(-1) for q in bucket])
            self.pending.append((k, flat, comm.all_reduce(flat, self.axis, async_op=True)))
        super().finish()


class BucketsLastTwice(_gb.BucketedGradSync):
    """Counts the last bucket twice: it is all-reduced in its hook and again in finish()."""

    def finish(self):
        k = len(self.buckets) - 1
        flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[k]])
        self.pending.append((k, flat, comm.all_reduce(flat, self.axis, async_op=True)))
        super().finish()


class Zero1AllReduce(_z1.Zero1AdamW):
    """All-reduce the whole gradient, then all-gather the parameters: 3 psi where 2 psi do."""

    @torch.no_grad()
    def step(self):
        grad = self._flat(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
        comm.all_reduce(grad, self.axis, op="avg")
        i = self.axis.index
        self.local.grad = grad[i * self.shard:(i + 1) * self.shard].clone()
        self._update()

    def _update(self):
        self.optimizer.step()
        full = torch.empty(self.shard * self.axis.size, dtype=self.local.dtype)
        comm.all_gather(full, self.local.detach(), self.axis)
        offset = 0
        for p in self.params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class Zero1Sum(Zero1AllReduce):
    """Reduce-scatter with op="sum": the gradient is not divided by the world size."""

    @torch.no_grad()
    def step(self):
        grad = self._flat(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))
        self.local.grad = torch.empty(self.shard, dtype=grad.dtype)
        comm.reduce_scatter(self.local.grad, grad, self.axis, op="sum")
        self._update()


class Zero1FullState(_z1.Zero1AdamW):
    """Every rank keeps AdamW state for all the parameters (ZeRO-0 with extra steps)."""

    def __init__(self, params, axis, **kw):
        super().__init__(params, axis, **kw)
        self.optimizer = torch.optim.AdamW(self.params, **kw)

    @torch.no_grad()
    def step(self):
        for p in self.params:
            comm.all_reduce(p.grad, self.axis, op="avg")
        self.optimizer.step()


class SwappedCopy(_tp.ReduceFromTP):
    """f and g swapped: 'copy' all-reduces going forward, identity going backward."""


class SwappedReduce(_tp.CopyToTP):
    """... and 'reduce' is the identity going forward, all-reduce going backward."""


def swapped_column(x, w, b, axis):
    return F.linear(SwappedCopy.apply(x, axis), w, b)


def swapped_row(x, w, b, axis):
    return SwappedReduce.apply(F.linear(x, w), axis) + b


def column_no_f(x, w, b, axis):
    """Column layer without f: the input gradient is never all-reduced."""
    return F.linear(x, w, b)


def row_bias_before_sum(x, w, b, axis):
    """Bias added to every partial product, so it is summed tp times."""
    return _tp.ReduceFromTP.apply(F.linear(x, w, b), axis)


def ce_padded_gather(logits, targets, vocab_start, axis):
    """All-reduces zero-padded (N, V) logits: a gather by another name, then F.cross_entropy."""
    n, v_local = logits.shape
    full = torch.zeros(n, v_local * axis.size, dtype=logits.dtype)
    full[:, vocab_start:vocab_start + v_local] = logits.detach()
    comm.all_reduce(full, axis)
    full = full.requires_grad_(True)
    loss = F.cross_entropy(full, targets)
    (g,) = torch.autograd.grad(loss, full)
    return _Local.apply(logits, loss.detach(), g[:, vocab_start:vocab_start + v_local])


class _Local(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, loss, grad):
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, up):
        (g,) = ctx.saved_tensors
        return g * up, None, None


class CENoMean(_ce.VocabParallelCrossEntropy):
    """Backward forgets the 1 / N of the mean."""

    @staticmethod
    def backward(ctx, grad):
        g, *rest = _ce.VocabParallelCrossEntropy.backward(ctx, grad)
        return (g * ctx.saved_tensors[0].shape[0], *rest)


def ce_no_mean(logits, targets, vocab_start, axis):
    return CENoMean.apply(logits, targets, vocab_start, axis)


WRONG = {
    "ring_allreduce": [
        ("library_all_reduce", variant("ring_allreduce", "comm.all_reduce, not a ring", ring_all_reduce=ring_library)),
        ("whole_tensor", variant("ring_allreduce", "whole tensors around the ring", ring_all_reduce=ring_whole_tensor)),
        ("no_average", variant("ring_allreduce", "average=True not divided",
                               ring_all_reduce=lambda t, axis, average=False: _ring(t, axis, False))),
    ],
    "grad_buckets": [
        ("no_divide", variant("grad_buckets", "forgets to divide by world size", BucketedGradSync=BucketsNoDivide)),
        ("at_the_end", variant("grad_buckets", "all buckets after backward", BucketedGradSync=BucketsAtTheEnd)),
        ("last_twice", variant("grad_buckets", "the last bucket counted twice", BucketedGradSync=BucketsLastTwice)),
    ],
    "zero1": [
        ("all_reduce", variant("zero1", "all-reduce + all-gather: 3 psi", Zero1AdamW=Zero1AllReduce)),
        ("sum_not_average", variant("zero1", "forgets to divide by world size", Zero1AdamW=Zero1Sum)),
        ("full_state", variant("zero1", "optimizer state not sharded", Zero1AdamW=Zero1FullState)),
    ],
    "tp_linear": [
        ("f_g_swapped", variant("tp_linear", "f and g swapped", column_parallel_linear=swapped_column,
                                row_parallel_linear=swapped_row)),
        ("no_f", variant("tp_linear", "column layer without f", column_parallel_linear=column_no_f)),
        ("bias_before_sum", variant("tp_linear", "row bias added tp times", row_parallel_linear=row_bias_before_sum)),
    ],
    "vocab_ce": [
        ("padded_gather", variant("vocab_ce", "all-reduce of padded logits", vocab_parallel_cross_entropy=ce_padded_gather)),
        ("no_mean", variant("vocab_ce", "gradient not divided by N", vocab_parallel_cross_entropy=ce_no_mean)),
    ],
}
