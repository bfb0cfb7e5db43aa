"""Vocab-parallel cross-entropy: the loss of logits split over tp along the vocabulary, computed
without ever putting the full (B, T, V) logits on one rank.

For token n with logits z (spread over tp ranks) and target t:

    loss_n = log sum_v exp(z_v - m) - (z_t - m),    m = max_v z_v

Each rank holds a slice of v. Two all-reduces over tp, of size N and 2N floats, suffice:

1. max: m = all_reduce_max(local max)                      (numerical stability)
2. sum: [sum_v exp(z_v - m), z_t - m] = all_reduce_sum(local [sum exp, target logit or 0])
   (only the rank whose slice holds t contributes the target logit; the others add 0)

The backward needs no communication: dloss_n/dz_v = softmax_v - [v == t], and each rank already has
its slice of softmax (exp(z - m) / the all-reduced sum). Padded vocabulary columns (global index
>= vocab_size) are set to -inf before step 1, so their probability and gradient are exactly 0.
The result is the mean over all B*T tokens, the value `F.cross_entropy` gives on the full logits.
"""

from __future__ import annotations

import torch

from mini3d import comm


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: mean cross-entropy of vocab-sharded logits (2 all-reduces over tp, see module doc).
    Backward: (softmax - one_hot(target)) / N on this rank's vocab slice; no communication."""

    @staticmethod
    def forward(ctx, logits, targets, axis, vocab_start: int, vocab_size: int):
        # ONE float32 (at least) copy of the logits, which becomes the softmax in place: shift,
        # exp and normalise all write into it (three separate results would hold three
        # logits-sized buffers at once, 3 x N x V/tp x 4 bytes at the loss's peak)
        z = logits.reshape(-1, logits.shape[-1]).to(
            torch.promote_types(logits.dtype, torch.float32), copy=True)  # (N, V/tp)
        t = targets.reshape(-1)
        n_local = z.shape[1]
        n_pad = vocab_start + n_local - vocab_size  # padding columns at the end of this slice
        if n_pad > 0:  # known from Python ints: no host sync (a tensor test would wait for the GPU)
            z[:, n_local - min(n_pad, n_local):] = float("-inf")
        m = z.max(dim=1).values  # (N,)
        if axis.size > 1:
            comm.all_reduce(m, axis, op="max")
        z.sub_(m.unsqueeze(1))
        outside = (t < vocab_start) | (t >= vocab_start + n_local)
        local_t = (t - vocab_start).masked_fill(outside, 0)
        zt = z.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0)
        e = z.exp_()
        sums = torch.stack([e.sum(dim=1), zt])  # (2, N)
        if axis.size > 1:
            comm.all_reduce(sums, axis)
        loss = sums[0].log() - sums[1]  # (N,)
        e.div_(sums[0].unsqueeze(1))  # softmax slice
        ctx.save_for_backward(e, local_t, outside)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, outside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= (~outside).to(g.dtype)
        g.mul_(grad / g.shape[0])
        return g.view(ctx.shape).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, axis, vocab_start: int = 0,
                                 vocab_size: int | None = None):
    """Mean cross-entropy; logits (B, T, V/tp) are this rank's vocab columns starting at
    `vocab_start`, targets (B, T) are global ids; columns at or past `vocab_size` are padding."""
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[-1]
    return VocabParallelCrossEntropy.apply(logits, targets, axis, vocab_start, vocab_size)


class VocabParallelLoss:
    """The `head.loss_fn` installed by `apply_tp`: a picklable callable(logits, targets)."""

    def __init__(self, axis, vocab_start: int, vocab_size: int):
        self.axis, self.vocab_start, self.vocab_size = axis, vocab_start, vocab_size

    def __call__(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.axis, self.vocab_start,
                                            self.vocab_size)

    def __repr__(self):
        return f"VocabParallelLoss(tp={self.axis.size}, vocab_start={self.vocab_start}, " \
               f"vocab_size={self.vocab_size})"


__all__ = ["vocab_parallel_cross_entropy", "VocabParallelCrossEntropy", "VocabParallelLoss"]
