"""Exercise tp_linear: Megatron's f and g operators, and column- / row-parallel Linear layers.

Chapter: 04 tensor parallelism (course/04_tensor_parallelism.ipynb)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mini3d import comm


class CopyToTP(torch.autograd.Function):
    """The `f` operator. Forward: identity (each tp rank already holds the whole input).
    Backward: all-reduce (sum) the input gradient over the tp axis, since every rank's partial
    output contributed to it."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.axis)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """The `g` operator. Forward: all-reduce (sum) the partial outputs over the tp axis.
    Backward: identity (the summed output's gradient is every partial output's gradient)."""

    @staticmethod
    def forward(ctx, x, axis):
        x = x.contiguous().clone()
        comm.all_reduce(x, axis)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def column_parallel_linear(x, weight_shard, bias_shard, axis):
    """y_i = f(x) @ W_i^T + b_i: this rank's slice of the output features (weight rows split)."""
    return F.linear(CopyToTP.apply(x, axis), weight_shard, bias_shard)


def row_parallel_linear(x_shard, weight_shard, bias, axis):
    """y = g(x_i @ W_i^T) + b: input features split (weight columns), partial sums all-reduced,
    the full bias added once after the sum."""
    return ReduceFromTP.apply(F.linear(x_shard, weight_shard), axis) + bias
