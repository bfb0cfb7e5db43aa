"""Exercise ring_allreduce: an all-reduce built only from point-to-point sends and receives.

Chapter: 02 data parallelism (course/02_data_parallelism.ipynb)
"""
from __future__ import annotations
import torch
from mini3d import comm

def ring_all_reduce(tensor: torch.Tensor, axis, average: bool=False) -> torch.Tensor:
    """Sum (or average) `tensor` in place over the members of `axis`, and return it.

    The bandwidth-optimal ring: split the flattened tensor into axis.size chunks (the last ones may
    be shorter, even empty). Reduce-scatter: in step s (0..n-2) member i sends chunk (i - s) to
    member i+1 and adds the chunk (i - s - 1) it receives from member i-1; afterwards member i holds
    the full sum of chunk (i + 1). All-gather: n-1 more steps pass the finished chunks around.
    Use only `comm.send` / `comm.recv` on `axis`, in an order that cannot deadlock: here every
    member posts its send asynchronously, then receives, then waits for its send."""
    raise NotImplementedError('split tensor.view(-1) into axis.size chunks; n-1 reduce-scatter steps then n-1 all-gather steps, each an async comm.send to axis.peer(1) and a comm.recv from axis.peer(-1)')
