"""The zig-zag layout of a sequence over the cp ranks, and which attention blocks a rank computes.

With a causal mask, splitting a sequence into cp contiguous pieces would leave the last rank with the
most work (its queries see every key) and the first with almost none. Instead the sequence is cut
into 2*cp equal chunks and rank r holds two of them, chunks r and 2cp-1-r (one early, one late), as
Megatron-Core, torchtitan and ring-flash-attention do. Worked example, cp=2, seq_len=8 (chunks of 2):

    chunk :  0    1    2    3          rank 0 holds chunks 0 and 3: positions 0 1 6 7
    token : 0 1  2 3  4 5  6 7         rank 1 holds chunks 1 and 2: positions 2 3 4 5

Each rank's local sequence is its two chunks side by side, (B, 2c, ...) with c = seq_len / (2 cp).
Every (query chunk i, key chunk j) pair of equal-length chunks is either fully visible (j < i),
causal on its diagonal (j == i: the usual lower-triangular mask) or invisible (j > i), so ring
attention computes each block with `is_causal` True or False, never an arbitrary mask.
"""

from __future__ import annotations

import torch


def zigzag_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices (of 2*cp) that cp rank `cp_rank` holds, in local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def zigzag_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global token positions of this rank's local sequence, (2 * seq_len / (2cp),) int64."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in zigzag_chunks(cp_rank, cp)])


def zigzag_split(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of a full-sequence tensor, concatenated along `dim`."""
    if cp == 1:
        return x
    parts = x.chunk(2 * cp, dim=dim)
    return torch.cat([parts[i] for i in zigzag_chunks(cp_rank, cp)], dim=dim)


def zigzag_merge(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `zigzag_split`: the full sequence from every cp rank's local piece (by cp rank)."""
    cp = len(pieces)
    chunks: list = [None] * (2 * cp)
    for r, p in enumerate(pieces):
        a, b = p.chunk(2, dim=dim)
        i, j = zigzag_chunks(r, cp)
        chunks[i], chunks[j] = a, b
    return torch.cat(chunks, dim=dim)


def block_kind(q_chunk: int, k_chunk: int) -> bool | None:
    """How query chunk `q_chunk` sees key chunk `k_chunk` under a causal mask: False (fully
    visible, no mask), True (the diagonal: causal mask) or None (invisible: skip the block)."""
    if k_chunk < q_chunk:
        return False
    return True if k_chunk == q_chunk else None


def chunk_batch(x: torch.Tensor, y: torch.Tensor, cp: int, cp_rank: int):
    """This cp rank's share of a micro-batch: (inputs, targets, positions), the zig-zag chunks of
    every sequence of (b, s) token ids x and targets y, and the (2c,) global positions of them."""
    return (zigzag_split(x, cp, cp_rank), zigzag_split(y, cp, cp_rank),
            zigzag_positions(x.shape[1], cp, cp_rank, device=x.device))


def chunk_micro_batches(micro_batches: list, cp: int, cp_rank: int) -> list:
    """This cp rank's share of every (x, y) micro-batch (`chunk_batch`: (x, y, positions) each);
    unchanged when cp == 1. What training, validation and the dry run's recorded step all feed the
    model: a cp rank's pipeline boundary and ring attention expect (b, seq_len / cp) chunks."""
    if cp == 1:
        return micro_batches
    return [chunk_batch(x, y, cp, cp_rank) for x, y in micro_batches]
