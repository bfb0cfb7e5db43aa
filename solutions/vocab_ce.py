"""Exercise vocab_ce: cross-entropy over logits whose vocabulary dim is split over tp ranks.

Chapter: 04 tensor parallelism (course/04_tensor_parallelism.ipynb)
"""

from __future__ import annotations

import torch

from mini3d import comm


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: mean over tokens of logsumexp(all logits) - logit[target], computed from vocab shards
    with three all-reduces of per-token numbers (max, sum of exponentials, target logit), never
    gathering the (N, V) logits. Backward: d loss / d logits_i = (softmax_i - onehot_i) / N, local."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, axis):
        n, v_local = logits.shape
        m = logits.detach().max(dim=1).values
        comm.all_reduce(m, axis, op="max")
        shifted = logits.detach() - m[:, None]  # stable: exponentials <= 1
        exp = shifted.exp()
        total = exp.sum(dim=1)
        comm.all_reduce(total, axis)
        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < v_local)
        picked = torch.zeros(n, dtype=logits.dtype)
        rows = mine.nonzero().view(-1)
        picked[rows] = shifted[rows, local_t[rows]]
        comm.all_reduce(picked, axis)
        ctx.save_for_backward(exp / total[:, None], local_t, mine)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, mine = ctx.saved_tensors
        g = softmax.clone()
        rows = mine.nonzero().view(-1)
        g[rows, local_t[rows]] -= 1
        return g * grad / g.shape[0], None, None, None


def vocab_parallel_cross_entropy(logits_shard, targets, vocab_start: int, axis):
    """Mean cross-entropy; `logits_shard` (N, V/tp) holds vocabulary ids vocab_start.. of each token,
    `targets` (N,) are global ids. Must not all-gather the logits."""
    return VocabParallelCrossEntropy.apply(logits_shard, targets, vocab_start, axis)
