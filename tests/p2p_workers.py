"""Workers for tests/test_p2p_check.py (spawned by mini3d.launch: importable, top level)."""

import torch
import torch.distributed as dist

from mini3d import comm
from mini3d.grid import Grid, build_topology


def ring_batches(rounds: int, old: bool = False) -> list:
    """Every rank sends its rank id to the next and receives from the previous, `rounds` times, as
    one `comm.batch_p2p` (or, `old`, a plain send then a receive: fine on gloo)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    topo = build_topology(Grid(cp=world), rank)
    axis, got = topo.cp, []
    for t in range(rounds):
        out = torch.full((3,), float(rank * 10 + t), device="cpu")
        inc = torch.empty(3, device="cpu")
        if old:
            works = [comm.send(out, axis, axis.peer(1), async_op=True),
                     comm.recv(inc, axis, axis.peer(-1), async_op=True)]
        else:
            works = [comm.batch_p2p([("send", out, axis.peer(1)), ("recv", inc, axis.peer(-1))],
                                    axis, async_op=True)]
        for w in works:
            w.wait()
        got.append(inc[0].item())
    batches = {ev.batch for ev in topo.log.events}
    return {"got": got, "batches": len(batches - {None}), "events": len(topo.log.events),
            "pending": len(topo.log.pending)}


def crossing_sends() -> None:
    """Both of two ranks post a send to the other, then a receive: gloo runs it, NCCL would not."""
    rank = dist.get_rank()
    topo = build_topology(Grid(cp=2), rank)
    out, inc = torch.ones(2, device="cpu"), torch.empty(2, device="cpu")
    w = comm.send(out, topo.cp, 1 - rank, async_op=True)
    comm.recv(inc, topo.cp, 1 - rank)
    w.wait()
