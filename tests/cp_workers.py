"""Worker functions for tests/test_cp.py (spawned by mini3d.launch)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mini3d.cp.layout import zigzag_split
from mini3d.cp.ring import ring_attention
from mini3d.grid import Grid, build_topology

SHAPE = (2, 3, 16, 8)  # (B, nh, s, hd): s = 16 splits into 2*cp chunks for cp = 2 and 4


def full_inputs(seed: int = 0):
    """The same full-sequence q, k, v and upstream gradient on every rank (and in the test)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(4)]


def ring_cases(cases: list[dict]) -> list[dict]:
    """For each case {"cp", "dp", "kind"}: ring attention of this rank's zig-zag chunks, forward and
    backward; returns (per case) this rank's cp index, out and the q/k/v gradients (local chunks)."""
    rank, out = dist.get_rank(), []
    for case in cases:
        topo = build_topology(Grid(dp=case["dp"], cp=case["cp"]), rank)
        cp = topo.cp
        q, k, v, dout = (zigzag_split(t, cp.size, cp.index, dim=2) for t in full_inputs())
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        o = ring_attention(q, k, v, cp, case["kind"])
        o.backward(dout)
        out.append({"cp_rank": cp.index, "dp_rank": topo.dp.index, "out": o.detach(),
                    "dq": q.grad, "dk": k.grad, "dv": v.grad,
                    "sends": topo.log.count("cp", "send"), "bytes": topo.log.bytes_by_axis["cp"]})
    return out
