"""Context parallelism: the sequence split over the cp axis, attention computed by ring attention.

layout.py  the zig-zag assignment of sequence chunks to cp ranks, and each block's mask kind
blocks.py  attention of one query block against one key/value block with its log-sum-exp, the
           combination rule, and the flash-style block backward
ring.py    the ring: K/V blocks (and in backward their dK/dV accumulators) travel the cp axis
apply.py   the transform: ring attention in every block, the chunk's positions on the model
"""

from mini3d.cp.apply import apply_cp, set_positions
from mini3d.cp.layout import (chunk_batch, chunk_micro_batches, zigzag_chunks, zigzag_merge,
                              zigzag_positions, zigzag_split)
from mini3d.cp.ring import RingCore, ring_attention

__all__ = ["RingCore", "apply_cp", "chunk_batch", "chunk_micro_batches", "ring_attention",
           "set_positions", "zigzag_chunks", "zigzag_merge", "zigzag_positions", "zigzag_split"]
