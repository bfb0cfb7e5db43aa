"""Benchmark: mini3d's tensor-parallel MLP block vs PyTorch's `torch.distributed.tensor.parallel`.

Both sides run the same block, y = proj(gelu(fc(x))), split over 2 processes on gloo/CPU, built from
the same full `nn.Linear` weights: mini3d with ColumnParallelLinear + RowParallelLinear (f / g),
PyTorch with ColwiseParallel + RowwiseParallel on a 1-D DeviceMesh (DTensor). One step is forward
plus backward (the input requires grad, so both sides all-reduce its gradient). The two are
interleaved, alternating which goes first, and each step is fenced by a barrier; times are rank 0's.
The script also checks that both produce the same output and input gradient.

    python benchmarks/tp_bench.py           # full table
    python benchmarks/tp_bench.py --quick   # one small shape, few repeats

`run(quick)` returns the rows for the combined `python -m benchmarks` table.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mini3d import comm
from mini3d.grid import Grid, build_topology
from mini3d.launch.launcher import launch
from mini3d.tp import ColumnParallelLinear, RowParallelLinear

from benchmarks.common import ratio_row

TP = 2


class MLP(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class OursMLP(nn.Module):
    def __init__(self, full: MLP, axis):
        super().__init__()
        self.fc = ColumnParallelLinear(full.fc, axis)
        self.proj = RowParallelLinear(full.proj, axis)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


def _theirs(full: MLP):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (TP,))
    return parallelize_module(copy.deepcopy(full), mesh,
                              {"fc": ColwiseParallel(), "proj": RowwiseParallel()})


def _step(module, x, axis) -> float:
    module.zero_grad(set_to_none=True)
    x.grad = None
    comm.barrier(axis)
    t0 = time.perf_counter()
    module(x).sum().backward()
    return time.perf_counter() - t0


def _worker(shapes, repeats: int, warmup: int):
    """On each of TP ranks: time both implementations on each shape; rank 0 returns the rows."""
    topo = build_topology(Grid(tp=TP), dist.get_rank())
    rows = []
    for b, s, h, f in shapes:
        torch.manual_seed(0)  # identical full weights and input on every rank
        full = MLP(h, f)
        ours, theirs = OursMLP(full, topo.tp), _theirs(full)
        x = torch.randn(b, s, h, requires_grad=True)
        y_ours = ours(x)
        y_ours.sum().backward()
        g_ours, x.grad = x.grad, None
        y_theirs = theirs(x)
        y_theirs.sum().backward()
        same = (torch.allclose(y_ours, y_theirs, atol=1e-5)
                and torch.allclose(g_ours, x.grad, atol=1e-5))
        times = {"ours": [], "theirs": []}
        for i in range(warmup + repeats):
            order = [("ours", ours), ("theirs", theirs)]
            for name, mod in (order if i % 2 == 0 else order[::-1]):
                t = _step(mod, x, topo.tp)
                if i >= warmup:
                    times[name].append(t)
        o, t = times["ours"], times["theirs"]
        rows.append({**ratio_row(f"tp={TP} MLP fwd+bwd b={b} s={s} h={h} ffn={f}", o, t, goal=1.05),
                     "ours_min": min(o), "ours_median": statistics.median(o), "ours_max": max(o),
                     "theirs_min": min(t), "theirs_median": statistics.median(t),
                     "theirs_max": max(t), "repeats": repeats, "same_result": bool(same)})
    return rows


def run(quick: bool = False) -> list[dict]:
    """Rows: name, ours_s, theirs_s (medians), ratio (ours / theirs), min/median/max of each."""
    shapes = [(4, 128, 256, 1024)] if quick else [(4, 128, 256, 1024), (8, 256, 512, 2048)]
    repeats, warmup = (10, 2) if quick else (30, 5)
    return launch(_worker, TP, shapes, repeats, warmup, timeout=600)[0]


def format_table(rows: list[dict]) -> str:
    head = f"{'benchmark':<44} {'ours ms (min/med/max)':>24} {'torch ms (min/med/max)':>24} " \
           f"{'ratio':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = lambda k: f"{r[k + '_min'] * 1e3:.2f}/{r[k + '_median'] * 1e3:.2f}/{r[k + '_max'] * 1e3:.2f}"
        flag = "" if r["same_result"] else "  (RESULTS DIFFER)"
        lines.append(f"{r['name']:<44} {ms('ours'):>24} {ms('theirs'):>24} {r['ratio']:>5.2f}x{flag}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table(run(quick="--quick" in sys.argv)))
