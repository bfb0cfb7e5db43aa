"""Exercise lse_merge: attention over two key blocks, combined with the log-sum-exp rule.

Chapter: 07b long sequences (course/07b_long_sequences.ipynb)

Ring attention never holds all the keys at once: each rank attends its queries to one block of
keys and values at a time, keeping for every query row the block's output and the log-sum-exp of
its scores, and folds the blocks together as they arrive. Write the two pieces. Shapes: q
(..., Tq, d), k and v (..., Tk, d); scores are q k^T / sqrt(d).
"""
from __future__ import annotations


def block_attention(q, k, v, causal: bool):
    """(out, lse) of softmax attention of q over this one block of keys and values.

    out (..., Tq, d) = softmax(scores) v over this block only; lse (..., Tq) = log sum_j exp(score_j).
    causal=True (a diagonal block, Tq == Tk): query i sees keys 0..i of the block only."""
    raise NotImplementedError("ordinary softmax attention over this block; a score of -inf "
                              "vanishes under exp, and torch can take a row's log-sum-exp without "
                              "overflow: how does lse relate to softmax's denominator?")


def merge(out_a, lse_a, out_b, lse_b):
    """(out, lse) of attention over the keys of block A and block B together, from the two blocks'
    results. Must stay finite for scores in the thousands (float32 exp overflows above ~88)."""
    raise NotImplementedError("each block's out is a weighted mean whose weights sum to exp(its "
                              "lse): what share of the combined total is each block's? Compute it "
                              "without ever taking exp of a large number")
