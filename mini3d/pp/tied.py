"""Tied embeddings across pipeline stages: Megatron's embedding group.

A model with `tie_embeddings` uses one matrix twice: the token embedding (first stage) and the
output head (last stage). With pp > 1 those are different ranks, so the last stage holds its own
copy of the matrix, initialised equal (`mini3d.models.transformer.canonical_name`). After backward each copy has
only its own use's gradient; the matrix's gradient is their sum, so both copies add the other's
(one all-reduce over the `embedding` axis: pipeline ranks 0 and p-1 of each tp x dp position, see
mini3d.grid) and then take the same optimizer step, staying equal.

The sum runs as an optimizer grad hook, after the pipeline's backward and the dp gradient sync
(sums commute with the dp average), so the pipeline schedules know nothing about it. Under ZeRO-1/2
each rank of ZeRO's shard group holds a different slice of each stage's flat gradient, and the first
and last stages' flat layouts differ, so the pieces are first put back into the whole matrix
gradient over that group: `topo.dp_cp`, the group the dp wrapper reduces and shards every gradient
over (cp x dp; the dp axis when cp = 1). Assembling over dp alone would, with cp > 1, miss the
slices the other cp ranks hold, so part of the other end's gradient would never be added.
"""

from __future__ import annotations

import torch

from mini3d import comm


def tied_end(stages: dict, cfg, pp: int):
    """This rank's end of a tie that spans stages: the first stage's embedding weight or the last
    stage's head weight (marked `tied_copy`, so the global gradient norm counts the matrix once);
    None when the model is untied, pp == 1, or this rank holds neither end."""
    if not cfg.tie_embeddings or pp == 1:
        return None
    for module in stages.values():
        if module.embed is not None and module.head is None:
            return module.embed.wte.weight
        if module.head is not None and module.embed is None:
            module.head.out.weight.tied_copy = True
            return module.head.out.weight
    return None


def _piece(local_grads, param):
    """(this rank's slice of `param`'s gradient in the local flat gradients, its [lo, hi) range in
    the flattened parameter); (None, None) when this dp rank's shard holds none of it."""
    for group, g in local_grads:
        base = 0 if g.numel() == group.padded else group.lo
        for p, off in zip(group.params, group.offsets):
            if p is param:
                lo, hi = max(off, base), min(off + p.numel(), base + g.numel())
                if lo >= hi:
                    return None, None
                return g[lo - base:hi - base], (lo - off, hi - off)
    raise ValueError("the tied parameter is in no gradient group")


@torch.no_grad()
def sum_tied_grads(local_grads, param, topo, sharded_over_dp: bool) -> None:
    """Add, in place, the other end's gradient to this end's (collective over ZeRO's shard group,
    cp x dp, when sharded, then over the embedding axis)."""
    piece, span = _piece(local_grads, param)
    dtype = local_grads[0][1].dtype
    full = torch.zeros(param.numel(), dtype=dtype, device=local_grads[0][1].device)
    if piece is not None:
        full[span[0]:span[1]] = piece
    if sharded_over_dp:
        comm.all_reduce(full, topo.dp_cp)  # disjoint slices: the sum assembles the whole gradient
    comm.all_reduce(full, topo.axes["embedding"])
    if piece is not None:
        piece.copy_(full[span[0]:span[1]])


def tie_across_stages(stages: dict, cfg, plan, topo, optimizer) -> None:
    """Register the gradient sum on the ranks of both ends (a no-op anywhere else)."""
    param = tied_end(stages, cfg, plan.pp)
    if param is not None:
        optimizer.grad_hooks.append(
            lambda local: sum_tied_grads(local, param, topo, plan.zero >= 1))


__all__ = ["tied_end", "sum_tied_grads", "tie_across_stages"]
