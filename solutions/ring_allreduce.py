"""Exercise ring_allreduce: an all-reduce built only from point-to-point sends and receives.

Chapter: 02 data parallelism (course/02_data_parallelism.ipynb)
"""

from __future__ import annotations

import torch

from mini3d import comm


def ring_all_reduce(tensor: torch.Tensor, axis, average: bool = False) -> torch.Tensor:
    """Sum (or average) `tensor` in place over the members of `axis`, and return it.

    The bandwidth-optimal ring: split the flattened tensor into axis.size chunks (the last ones may
    be shorter, even empty). Reduce-scatter: in step s (0..n-2) member i sends chunk (i - s) to
    member i+1 and adds the chunk (i - s - 1) it receives from member i-1; afterwards member i holds
    the full sum of chunk (i + 1). All-gather: n-1 more steps pass the finished chunks around.
    Use only `comm.send` / `comm.recv` on `axis`, in an order that cannot deadlock: here every
    member posts its send asynchronously, then receives, then waits for its send."""
    n, i = axis.size, axis.index
    if n == 1:
        return tensor
    flat = tensor.view(-1)
    bounds = [len(c) for c in torch.arange(flat.numel()).tensor_split(n)]
    starts = [sum(bounds[:k]) for k in range(n)]
    chunk = lambda k: flat[starts[k % n]:starts[k % n] + bounds[k % n]]  # noqa: E731
    nxt, prv = axis.peer(1), axis.peer(-1)

    def exchange(send_k, recv_k):
        out = chunk(send_k).clone()
        got = torch.empty_like(chunk(recv_k))
        work = comm.send(out, axis, nxt, async_op=True)
        comm.recv(got, axis, prv)
        work.wait()
        return got

    for s in range(n - 1):  # reduce-scatter
        recv_k = i - s - 1
        chunk(recv_k).add_(exchange(i - s, recv_k))
    for s in range(n - 1):  # all-gather
        recv_k = i - s
        chunk(recv_k).copy_(exchange(i - s + 1, recv_k))
    if average:
        tensor.div_(n)
    return tensor
