"""Gradients of a tensor-parallel model: the tp sums replicated parameters need under sequence
parallelism (`sync_tp_grads`, `sum_replicated_grads`) and the global norm clipping counts each
element of the unsharded model once (`clip_grad_norm_`), expert slices (mini3d.ep) included."""

from __future__ import annotations

import torch

from mini3d import comm
from mini3d.tp.parallelize import is_tp_sharded


def sync_tp_grads(model, topo) -> None:
    """Under sequence parallelism, sum over tp the gradients of the replicated parameters
    (LayerNorms, position embedding, row-parallel biases): each rank saw only its T/tp positions.
    One flattened all-reduce. A no-op without sequence parallelism or with tp=1."""
    if not getattr(model, "sequence_parallel", False) or topo.tp.size == 1:
        return
    _sum_in_place([p.grad for p in model.parameters() if not is_tp_sharded(p) and p.grad is not None],
                  topo.tp)


def _sum_in_place(tensors: list, axis) -> None:
    """Sum each tensor over `axis`, in place, with one all-reduce of their concatenation."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    comm.all_reduce(flat, axis)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _local_parts(local_grads):
    """(piece, parameter) for each parameter's piece of the local flat gradients that a
    data-parallel wrapper holds (`ShardedOptimizer.grad_hooks` items: (group, the whole flat
    gradient or this rank's lo:hi shard of it)); padding is left out."""
    for group, g in local_grads:
        base = 0 if g.numel() == group.padded else group.lo
        for p, off in zip(group.params, group.offsets):
            lo, hi = max(off, base), min(off + p.numel(), base + g.numel())
            if lo < hi and not getattr(p, "tied_copy", False):  # see mini3d.pp.tied
                yield g[lo - base:hi - base], p


def sum_replicated_grads(local_grads, tp_axis) -> None:
    """`sync_tp_grads` for gradients that a data-parallel wrapper already reduced over dp: sum over
    tp, in place, the parts of the local flat gradients that belong to replicated parameters. One
    flattened all-reduce; tp ranks hold equal layouts, so equal parts."""
    if tp_axis.size > 1:
        _sum_in_place([part for part, p in _local_parts(local_grads) if not is_tp_sharded(p)],
                      tp_axis)


@torch.no_grad()
def clip_grad_norm_(local_grads, topo, max_norm: float, sharded_over_dp: bool) -> torch.Tensor:
    """Scale the whole model's gradient, in place, so that its global L2 norm is at most `max_norm`
    (`torch.nn.utils.clip_grad_norm_` over the unsharded model: coefficient max_norm / (norm +
    1e-6), capped at 1); returns the norm before clipping, the same on every rank, as a 0-dim
    float64 tensor on the device (reading it is the caller's host sync).

    Each element is counted once: tp-sharded pieces are summed over tp, replicated ones (equal on
    every tp rank, after `sum_replicated_grads`) taken once; ZeRO >= 1 shards are summed over their
    shard group, `topo.dp_cp` (cp x dp: the group the dp wrapper reduces every gradient over),
    replicas (ZeRO-0: equal on every cp x dp rank after its average) not; pipeline stages are summed
    over pp (a tied head's copy, `tied_copy`, is left out: the matrix counts once). Expert slices
    (`ep_expert`, mini3d.ep: a different E/ep of the experts on each ep rank) are summed over ep,
    and over tp taken once where whole on every tp rank, summed where split over tp
    (`--expert-tp`, mini3d.tp.experts: a different F/tp of each expert on each tp rank); under
    ZeRO >= 1 their edp shards and the ep slices together tile dp x cp, so the one dp_cp sum counts
    them once too. Each piece's norm is taken in float32 (as torch does; float64 in float64 runs),
    the squares are summed in float64."""
    # [replicated, tp-sharded, expert whole over tp, expert split over tp]: norms per piece
    norms = ([], [], [], [])
    for part, p in _local_parts(local_grads):
        wide = torch.promote_types(part.dtype, torch.float32)  # float64 runs: float64 norms
        kind = 2 * bool(getattr(p, "ep_expert", False)) + int(is_tp_sharded(p))
        norms[kind].append(torch.linalg.vector_norm(part, dtype=wide))
    dev = local_grads[0][1].device
    sq = torch.stack([torch.stack(n).double().square().sum() if n else
                      torch.zeros((), dtype=torch.float64, device=dev) for n in norms])
    # one tp all-reduce of the sums; the whole-on-every-tp-rank sums then count each element tp times
    comm.all_reduce(sq, topo.tp)
    t = topo.tp.size
    dense, experts = (sq[0] / t + sq[1]).reshape(1), (sq[2] / t + sq[3]).reshape(1)
    if sharded_over_dp:
        total = dense + experts
        comm.all_reduce(total, topo.dp_cp)  # ZeRO shards over cp x dp (the dp axis when cp=1)
    else:
        if topo.axes["ep"].size > 1:
            comm.all_reduce(experts, topo.axes["ep"])  # each ep rank's experts are its own
        total = dense + experts
    comm.all_reduce(total, topo.pp)
    # The norm stays on the device: no host sync (the trainer reads it with the loss, once a step).
    # The coefficient is computed as torch does, capped at 1 on the device; multiplying by an exact
    # 1.0 leaves a gradient unchanged, so the unclipped case needs no host decision either.
    norm = total.sqrt().reshape(())
    if max_norm != float("inf"):  # inf: the norm is wanted (--log-grad-norm), no clipping
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, g in local_grads:
            g.mul_(coef)
    return norm
