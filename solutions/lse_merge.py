"""Exercise lse_merge: attention over two key blocks, combined with the log-sum-exp rule.

Chapter: 07b long sequences (course/07b_long_sequences.ipynb)

Reference answer. mini3d's ring attention (`mini3d.cp.blocks`: block_forward and merge) does the
same, with the CPU flash-attention kernel as an alternative for the block.
"""
from __future__ import annotations

import math

import torch


def block_attention(q, k, v, causal: bool):
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)  # log(e^a + e^b), computed without overflow
    wa, wb = torch.exp(lse_a - lse).unsqueeze(-1), torch.exp(lse_b - lse).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse
