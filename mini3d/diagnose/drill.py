"""A comm-only imitation of one 3D-parallel training step, for fault drills and explain-hang lessons.

`drill_worker(spec)` runs `steps` steps of the communication pattern of Megatron-style training on
a (tp, pp, dp) grid, with small tensors and no model: per micro-batch, the forward receives the
activation from the previous stage, does two tp all-reduces (attention and MLP outputs), sends the
activation on; the backward mirrors it with gradients; after all micro-batches, one dp all-reduce
of the gradients. Every value is a known function of (step, micro-batch, coordinates), so the
result can be checked exactly: a `slow` fault must leave it unchanged.

It exercises the diagnostics (`diagnostics(topo, spec)`) on real multi-rank layouts through
`mini3d.comm` without building a model: each drill starts in a second, and its exact values show
that a fault changed nothing but timing (the trainer's own faults are tested in
tests/test_faults_trainer.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mini3d import comm
from mini3d.grid import Grid, build_topology
from mini3d.diagnose.session import diagnostics

ACT = (2, 4)  # the activation every stage passes on: (micro-batch rows, hidden)


def _fake_memory() -> dict:
    """What an OOM drill measures: a tiny model's worth of bytes in each state category."""
    return {"params": 4096, "grads": 4096, "optimizer": 8192, "activations": 0, "comm_buffers": 0}


def _stage(topo, step: int, mb: int, backward: bool) -> torch.Tensor:
    """One micro-batch through this stage (forward or backward): p2p in, two tp all-reduces, p2p out."""
    pp, tp = topo.pp, topo.tp
    first, last = pp.index == 0, pp.index == pp.size - 1
    src = pp.peer(1) if backward else pp.peer(-1)
    has_input = (not last) if backward else (not first)
    action = "B" if backward else "F"
    topo.log.context = {"step": step, "action": f"{action}{pp.index}", "mb": mb}
    x = torch.full(ACT, float(step + mb + 1), device=topo.device)
    if has_input:
        comm.recv(x, pp, src)
    for _ in range(2):
        y = torch.full(ACT, float(tp.index + 1), device=topo.device) * x
        comm.all_reduce(y, tp)
        x = y / (tp.size * (tp.size + 1) / 2)  # back to x: the all-reduced sum of (i+1) x
    if not (first if backward else last):
        comm.send(x, pp, pp.peer(-1) if backward else pp.peer(1))
    return x


def drill_worker(spec: dict) -> dict:
    """Run the drill on this rank; returns the rank's per-step gradient sums (exactly predictable)."""
    grid = Grid(spec.get("tp", 1), spec.get("pp", 1), spec.get("dp", 1))
    topo = build_topology(grid, dist.get_rank())
    diag = diagnostics(topo, spec)
    sums = []
    for step in range(spec.get("steps", 3)):
        diag.step_start(step, _fake_memory)
        acc = torch.zeros(ACT, device=topo.device)
        for mb in range(spec.get("micro_batches", 2)):
            acc += _stage(topo, step, mb, backward=False)
            acc += _stage(topo, step, mb, backward=True)
        topo.log.context = {"step": step, "action": "grad-sync"}
        grad = acc + topo.dp.index
        comm.all_reduce(grad, topo.dp)
        sums.append(float(grad.sum()))
        diag.step_end(step)
    diag.finish()
    waits = [e.end - e.start for e in topo.log.events if e.end is not None]
    return {"rank": topo.rank, "coords": topo.coords, "sums": sums, "max_wait_s": max(waits, default=0.0)}


def expected_sums(spec: dict, dp_size: int) -> list[float]:
    """What every rank's `sums` must be without faults (the drill's values are data-independent)."""
    n = ACT[0] * ACT[1]
    out = []
    for step in range(spec.get("steps", 3)):
        acc = sum(2 * float(step + mb + 1) for mb in range(spec.get("micro_batches", 2)))
        out.append(n * (dp_size * acc + sum(range(dp_size))))
    return out


__all__ = ["drill_worker", "expected_sums", "ACT"]
