"""The communication of tensor parallelism, as small autograd Functions (Megatron-LM's mappings).

Shoeybi et al. 2019 split each transformer block into a column-parallel matmul followed by a
row-parallel one, and name two conjugate operators around that pair:

* `f` (copy to the tp region): identity forward, all-reduce of the gradient backward;
* `g` (reduce from the tp region): all-reduce forward, identity backward.

Sequence parallelism (Korthikanti et al. 2022) keeps the regions between blocks (LayerNorm, residual
adds) sharded along the sequence dim and replaces each all-reduce by an all-gather plus a
reduce-scatter, which move the same number of bytes in total:

* `gather_from_sequence` (takes the place of `f`): all-gather along the sequence forward,
  reduce-scatter backward;
* `reduce_scatter_to_sequence` (takes the place of `g`): reduce-scatter forward, all-gather backward.

Every op goes through `mini3d.comm` on the tp `Axis` it is given (so it is logged and counted), and
is the identity on a one-member axis. `comm.all_gather` / `comm.reduce_scatter` work on dim 0, so the
helpers below move the wanted dim to the front, communicate, and move it back.
"""

from __future__ import annotations

import torch

from mini3d import comm
from mini3d.graph_breaks import outside_graphs

SEQ_DIM = 1  # activations are (B, T, C): the sequence is dim 1


# ---------------------------------------------------------------------------------------------
# plain (non-autograd) helpers
# ---------------------------------------------------------------------------------------------

def _all_reduce(x: torch.Tensor, axis) -> torch.Tensor:
    """Sum over the axis into a fresh tensor (the input may be shared by other autograd branches)."""
    if axis.size == 1:
        return x
    out = x.contiguous().clone()
    comm.all_reduce(out, axis)
    return out


def _split(x: torch.Tensor, dim: int, axis) -> torch.Tensor:
    """This member's equal chunk of `x` along `dim`."""
    if axis.size == 1:
        return x
    if x.shape[dim] % axis.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over tp={axis.size}")
    return x.chunk(axis.size, dim)[axis.index].contiguous()


def _gather(x: torch.Tensor, dim: int, axis) -> torch.Tensor:
    """Concatenate every member's `x` along `dim`, in axis order."""
    if axis.size == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((axis.size * front.shape[0],) + tuple(front.shape[1:]))
    comm.all_gather(out, front, axis)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, axis) -> torch.Tensor:
    """Sum `x` over the axis and keep this member's chunk along `dim`."""
    if axis.size == 1:
        return x
    if x.shape[dim] % axis.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split over tp={axis.size}")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // axis.size,) + tuple(front.shape[1:]))
    comm.reduce_scatter(out, front, axis)
    return out.movedim(0, dim).contiguous()


# ---------------------------------------------------------------------------------------------
# autograd Functions
# ---------------------------------------------------------------------------------------------

class CopyToTP(torch.autograd.Function):
    """`f`. Forward: identity (every tp rank already holds the full input).
    Backward: all-reduce (sum) of the gradient over tp, since each rank's column shard contributed
    only part of dL/dx."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.axis), None


class ReduceFromTP(torch.autograd.Function):
    """`g`. Forward: all-reduce (sum) over tp of the row-parallel partial outputs.
    Backward: identity (the summed output's gradient is the gradient of each partial)."""

    @staticmethod
    def forward(ctx, x, axis):
        if axis.size > 1 and x.is_contiguous() and x.grad_fn is not None and x._base is None:
            # The partial output is a fresh matmul result that no backward needs: sum it in place
            # (no copy of the (B, T, C) activation per layer), telling autograd it changed.
            comm.all_reduce(x, axis)
            ctx.mark_dirty(x)
            return x
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the gradient along the
    last dim (each rank supplies the gradient of its own chunk)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _split(x, -1, axis)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.axis), None


class GatherFromTP(torch.autograd.Function):
    """Forward: all-gather along the last dim (e.g. column-parallel outputs into one tensor).
    Backward: keep this rank's chunk of the gradient's last dim."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _gather(x, -1, axis)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.axis), None


class GatherFromSequence(torch.autograd.Function):
    """Sequence parallelism's `f`. Forward: all-gather the (B, T/tp, C) shards along the sequence
    into (B, T, C). Backward: reduce-scatter along the sequence: each rank's column shard produced a
    partial dL/dx for all T positions; sum them and keep this rank's T/tp positions."""

    @staticmethod
    def forward(ctx, x, axis, dim=SEQ_DIM):
        ctx.axis, ctx.dim = axis, dim
        return _gather(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.axis), None, None


class ReduceScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's `g`. Forward: sum the row-parallel partial outputs (B, T, C) over tp
    and keep this rank's (B, T/tp, C) shard. Backward: all-gather the shard gradients along the
    sequence (every partial output gets the full gradient, as under `g`)."""

    @staticmethod
    def forward(ctx, x, axis, dim=SEQ_DIM):
        ctx.axis, ctx.dim = axis, dim
        return _reduce_scatter(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.axis), None, None


class ScatterToSequence(torch.autograd.Function):
    """Forward: keep this rank's chunk of the sequence (a replicated (B, T, C) becomes (B, T/tp, C)).
    Backward: all-gather the gradient along the sequence."""

    @staticmethod
    def forward(ctx, x, axis, dim=SEQ_DIM):
        ctx.axis, ctx.dim = axis, dim
        return _split(x, dim, axis)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.axis), None, None


# ---------------------------------------------------------------------------------------------
# thin public wrappers: each takes the tp Axis explicitly
# ---------------------------------------------------------------------------------------------

@outside_graphs  # torch.compiler.disable once a model is compiled (mini3d.graph_breaks)
def _outside_graphs(function, *args):
    """Run `function.apply(*args)` eagerly even inside a `torch.compile`d block (mini3d.run.compile):
    dynamo breaks the graph here, so the collective goes through `mini3d.comm` (and its event log)
    exactly as in eager mode. On a one-member axis every mapping is the identity and the wrappers
    return their input before reaching this, so a block on one tp rank compiles to one graph."""
    return function.apply(*args)


def copy_to_tp(x, axis):
    """`f`: identity forward, all-reduce backward."""
    return x if axis.size == 1 else _outside_graphs(CopyToTP, x, axis)


def reduce_from_tp(x, axis):
    """`g`: all-reduce forward, identity backward."""
    return x if axis.size == 1 else _outside_graphs(ReduceFromTP, x, axis)


def scatter_to_tp(x, axis):
    """Split the last dim forward, all-gather it backward."""
    return x if axis.size == 1 else _outside_graphs(ScatterToTP, x, axis)


def gather_from_tp(x, axis):
    """All-gather the last dim forward, split it backward."""
    return x if axis.size == 1 else _outside_graphs(GatherFromTP, x, axis)


def gather_from_sequence(x, axis, dim=SEQ_DIM):
    """All-gather along the sequence forward, reduce-scatter backward."""
    return x if axis.size == 1 else _outside_graphs(GatherFromSequence, x, axis, dim)


def reduce_scatter_to_sequence(x, axis, dim=SEQ_DIM):
    """Reduce-scatter along the sequence forward, all-gather backward."""
    return x if axis.size == 1 else _outside_graphs(ReduceScatterToSequence, x, axis, dim)


def scatter_to_sequence(x, axis, dim=SEQ_DIM):
    """Split the sequence forward, all-gather it backward."""
    return x if axis.size == 1 else _outside_graphs(ScatterToSequence, x, axis, dim)


__all__ = ["copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "gather_from_sequence",
           "reduce_scatter_to_sequence", "scatter_to_sequence", "CopyToTP", "ReduceFromTP",
           "ScatterToTP", "GatherFromTP", "GatherFromSequence", "ReduceScatterToSequence",
           "ScatterToSequence", "SEQ_DIM"]
