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
        raise NotImplementedError('see the class docstring: what does this operator do going forward?')

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError('see the class docstring: what does this operator do to the gradient?')

class ReduceFromTP(torch.autograd.Function):
    """The `g` operator. Forward: all-reduce (sum) the partial outputs over the tp axis.
    Backward: identity (the summed output's gradient is every partial output's gradient)."""

    @staticmethod
    def forward(ctx, x, axis):
        raise NotImplementedError('see the class docstring: what does this operator do going forward?')

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError('see the class docstring: what does this operator do to the gradient?')

def column_parallel_linear(x, weight_shard, bias_shard, axis):
    """y_i = f(x) @ W_i^T + b_i: this rank's slice of the output features (weight rows split)."""
    raise NotImplementedError("every rank already holds all of x, but x's gradient comes from every rank's slice: which of your two operators goes where, around the local matrix multiply?")

def row_parallel_linear(x_shard, weight_shard, bias, axis):
    """y = g(x_i @ W_i^T) + b: input features split (weight columns), partial sums all-reduced,
    the full bias added once after the sum."""
    raise NotImplementedError("each rank's product is only a partial sum: which operator completes it, and how many times may the bias be added?")
