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
        raise NotImplementedError('see the class docstring: what does this operator do going forward?')

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError('see the class docstring: what does this operator do to the gradient?')

def vocab_parallel_cross_entropy(logits_shard, targets, vocab_start: int, axis):
    """Mean cross-entropy; `logits_shard` (N, V/tp) holds vocabulary ids vocab_start.. of each token,
    `targets` (N,) are global ids. Must not all-gather the logits."""
    raise NotImplementedError('implement VocabParallelCrossEntropy: global max, global sum of exp, target logit from the owning shard, each via comm.all_reduce')
