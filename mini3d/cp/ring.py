"""Ring attention over the cp axis: each rank's queries meet every rank's keys and values as the K/V
blocks travel around the ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers").

Forward, on cp rank r with local q, k, v (its two zig-zag chunks, see layout.py): for t = 0..cp-1 it
holds the K/V block of rank (r - t) mod cp; it first posts the asynchronous send of that block to
rank r+1 and the receive of the next one from rank r-1 (one batch, `comm.batch_p2p`: see
`_exchange` for why it must be one on NCCL), then attends its queries to the block it
holds (each chunk pair fully visible, causal-diagonal or skipped), folds the partial result into its
running (out, lse) with the log-sum-exp rule, and only then waits for the exchange: the transfer
overlaps the block's compute wherever the backend progresses p2p ops in the background.

Backward runs the same ring. The K/V blocks travel again, and with each travels the accumulator of
its dK/dV: every rank adds its queries' contribution (flash-attention style, from the saved final
out and lse, so nothing (T, T) outlives one block) and passes it on; after cp hops each accumulator
is home. dQ stays local. Saved for backward: q, k, v, out and lse of the local chunks only.

Bytes per layer and micro-batch, per rank: forward (cp-1) K/V blocks of 2 * b * 2c * h_local
elements; backward (cp-1) K/V blocks again plus cp float32 dK/dV accumulators of the same shape.
"""

from __future__ import annotations

import math

import torch

from mini3d import comm
from mini3d.cp.blocks import block_backward, block_forward, merge
from mini3d.cp.layout import block_kind, zigzag_chunks
from mini3d.graph_breaks import outside_graphs


def _exchange(tensor: torch.Tensor, axis) -> tuple[torch.Tensor, list]:
    """Post, as one batch: send `tensor` to the next cp rank, receive the same shape from the
    previous one. Returns (incoming buffer, [work]): the last work completes the receive, all of
    them the send (here one work completes both). Batched because on
    NCCL a plain send first deadlocks the ring: at cp=2 both ranks' sends head their one pair stream
    and each waits for a receive queued behind the other's send; at cp >= 3 each first send joins a
    pair communicator in a cycle (see mini3d.diagnose.rendezvous)."""
    incoming = torch.empty_like(tensor)
    work = comm.batch_p2p([("send", tensor, axis.peer(1)), ("recv", incoming, axis.peer(-1))],
                          axis, async_op=True)
    return incoming, [work]


def _pairs(axis, t: int):
    """(local query piece, held key piece, is_causal) for every visible pair at ring step t."""
    cp, r = axis.size, axis.index
    mine, held = zigzag_chunks(r, cp), zigzag_chunks((r - t) % cp, cp)
    for qi, qc in enumerate(mine):
        for ki, kc in enumerate(held):
            causal = block_kind(qc, kc)
            if causal is not None:
                yield qi, ki, causal


class RingAttention(torch.autograd.Function):
    """Causal attention of the local q against the whole sequence's k, v spread over the cp axis.

    forward: out (B, nh, T_local, hd), K/V exchanged cp-1 times around the ring;
    backward: dq local; dk, dv accumulated around the ring and returned to their owner."""

    @staticmethod
    def forward(ctx, q, k, v, axis, kind: str, scale: float):
        cp = axis.size
        qs = q.chunk(2, dim=2)
        acc: list = [None, None]  # (out, lse) per local query piece
        kv = torch.stack([k, v]).contiguous()  # (2, B, nh, T_local, hd): one message per step
        for t in range(cp):
            nxt, works = _exchange(kv, axis) if t + 1 < cp else (None, [])
            ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for qi, ki, causal in _pairs(axis, t):
                part = block_forward(qs[qi], ks[ki], vs[ki], causal, kind, scale)
                acc[qi] = part if acc[qi] is None else merge(*acc[qi], *part)
            for w in works:
                w.wait()
            kv = nxt
        out = torch.cat([acc[0][0], acc[1][0]], dim=2)
        lse = torch.cat([acc[0][1], acc[1][1]], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.kind, ctx.scale = axis, kind, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        axis, cp = ctx.axis, ctx.axis.size
        qs, dos, outs, lses = (x.chunk(2, dim=2) for x in (q, dout, out, lse))
        wide = torch.promote_types(q.dtype, torch.float32)  # float64 runs: float64 sums
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        dqs = dq.chunk(2, dim=2)
        kv = torch.stack([k, v]).contiguous()
        dkv_in, pending = None, []  # the accumulator arriving for the next step; sends in flight
        for t in range(cp):
            nxt, works = _exchange(kv, axis) if t + 1 < cp else (None, [])
            ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            dkv = torch.zeros(kv.shape, dtype=wide, device=q.device)
            dks, dvs = dkv[0].chunk(2, dim=2), dkv[1].chunk(2, dim=2)
            for qi, ki, causal in _pairs(axis, t):
                dqp, dkp, dvp = block_backward(dos[qi], qs[qi], ks[ki], vs[ki], outs[qi], lses[qi],
                                               causal, ctx.kind, ctx.scale)
                dqs[qi].add_(dqp)
                dks[ki].add_(dkp)
                dvs[ki].add_(dvp)
            if dkv_in is not None:
                dkv_in[1].wait()
                dkv.add_(dkv_in[0])
            if cp > 1:  # pass the accumulator on; the one for the next block comes from behind
                incoming, acc_works = _exchange(dkv, axis)
                pending.append((acc_works, dkv))  # keep the tensor alive until it is sent
                dkv_in = (incoming, acc_works[-1])
            for w in works:
                w.wait()
            kv = nxt
        if dkv_in is not None:  # after cp hops, this rank's own block's dK/dV is home
            dkv_in[1].wait()
            dkv = dkv_in[0]
        for ws, _ in pending:
            for w in ws:
                w.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


@outside_graphs  # its p2p ring stays outside compiled graphs (mini3d.run.compile, mini3d.graph_breaks)
def ring_attention(q, k, v, axis, kind: str = "explicit", scale: float | None = None):
    """Ring attention of local (B, nh, T_local, hd) q, k, v over the cp `axis` (zig-zag layout).
    Grouped-query attention (k, v with nkv < nh heads): each key/value head is repeated for its
    nh / nkv query heads first (autograd sums their gradients back), as the block math wants equal
    heads; the ring then carries nh heads of K and V."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return RingAttention.apply(q, k, v, axis, kind, scale)


class RingCore:
    """An attention core (the `Attention.core` slot of mini3d.models.transformer) that runs ring attention on one
    cp axis with block math `kind` ("explicit" or "sdpa")."""

    # k and v travel around the ring as one stacked message: a caller whose v is narrower than
    # k (deepseek's latent attention) pads v with zero features and drops them from the output
    same_kv_width = True

    def __init__(self, axis, kind: str = "explicit"):
        self.axis, self.kind = axis, kind

    def __call__(self, q, k, v):
        return ring_attention(q, k, v, self.axis, self.kind)
