"""`apply_cp`: the context-parallel transform of a (tp-sliced) model or pipeline stage.

Only attention needs its neighbours' tokens, so only the attention core changes: it becomes ring
attention over the cp axis. Everything else (embeddings, LayerNorms, MLPs, the head and its loss) is
per token and runs unchanged on the rank's chunk; learned positions are looked up at the chunk's
global positions (`set_positions`). The loss of a rank is the mean over its chunk's tokens; equal
chunks make the mean over the cp group the mean over the whole sequence, and the parameters'
gradients are averaged over cp x dp (`Topology.dp_cp`) like data-parallel replicas.
"""

from __future__ import annotations

import torch.nn as nn

from mini3d.cp.ring import RingCore


def apply_cp(module: nn.Module, topo, attention: str) -> nn.Module:
    """Give every attention layer of `module` ring attention over `topo.cp` (block math
    `attention`: "explicit" or "sdpa"); a no-op without context parallelism."""
    if topo.cp.size == 1:
        return module
    for block in getattr(module, "blocks", {}).values():
        block.attn.core = RingCore(topo.cp, attention)
    return module


def set_positions(chunks, positions):
    """The global positions (T,) of this rank's tokens, read by every model chunk's forward (a
    pipeline stage is called with hidden states only, so the positions are set on the module)."""
    for chunk in chunks:
        chunk.positions = positions
