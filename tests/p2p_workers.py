"""Workers for tests/test_p2p_check.py (spawned by mini3d.launch.launcher: importable, top level)."""

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


def layouts_p2p(cases: list[dict], cfg_dict: dict) -> list:
    """One training step of each case ({"name", "plan"}) on its plan.world_size ranks (the others
    only help build the groups); returns, per case this rank ran, the slice of the process' p2p
    record (mini3d.comm_log.P2P_RECORD, on under MINI3D_CHECK_P2P=1) that the step wrote."""
    from mini3d.comm_log import P2P_RECORD
    from mini3d.config import ModelConfig, Plan
    from mini3d.cp import chunk_batch
    from mini3d.run.train import Trainer
    from tests.cp_workers import _groups_only

    cfg, rank, out = ModelConfig(**cfg_dict), dist.get_rank(), []
    gen = torch.Generator().manual_seed(0)
    for case in cases:
        plan = Plan(**case["plan"])
        grid = Grid(plan.tp, plan.pp, plan.dp, cp=plan.cp)
        if rank >= plan.world_size:
            _groups_only(grid)
            dist.barrier()
            out.append({"name": case["name"], "record": None})
            continue
        topo = build_topology(grid, rank)
        trainer = Trainer(cfg, plan, topo, 0, 1e-3)
        start = len(P2P_RECORD.entries)
        x = torch.randint(cfg.vocab_size, (plan.micro_batches, plan.micro_batch_size, plan.seq_len),
                          generator=gen, device="cpu")
        mbs = [chunk_batch(xi, xi, plan.cp, topo.cp.index) if plan.cp > 1 else (xi, xi) for xi in x]
        trainer.step(mbs, 0)
        out.append({"name": case["name"], "record": P2P_RECORD.entries[start:]})
        comm.barrier(topo.axes["world"])
    return out
