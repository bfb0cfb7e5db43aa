"""Functions that spawned test workers run (they must live in an importable module)."""

import os
import time

import torch
import torch.distributed as dist

from mini3d import comm
from mini3d.grid import Grid, build_topology


def rank_info(scale):
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "value": scale * dist.get_rank(),
            "pid": os.getpid()}


def raise_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()  # the others wait for the failed rank: the launcher must stop them
    return dist.get_rank()


def hang_on(bad_rank):
    if dist.get_rank() == bad_rank:
        time.sleep(3600)
    return os.getpid()


def write_pid_then(path, mode):
    with open(os.path.join(path, f"pid{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    if mode in ("hang", "raise"):
        dist.barrier()  # every rank has written its pid before one of them misbehaves
    if mode == "hang" and dist.get_rank() == 1:
        time.sleep(3600)
    if mode == "raise" and dist.get_rank() == 1:
        raise RuntimeError("boom")
    if mode in ("hang", "raise"):
        dist.barrier()
    return os.getpid()


def comm_ops(tp, pp, dp):
    """Every traced op once on the tp axis, plus send/recv along pp; returns the event log."""
    grid = Grid(tp, pp, dp)
    topo = build_topology(grid, dist.get_rank())
    with topo.device:  # this test is about the ops, not about device placement (strict mode)
        ax = topo.tp
        x = torch.full((3, 4), float(ax.index + 1))
        comm.all_reduce(x, ax)
        out = torch.empty(3 * ax.size, 4)
        comm.all_gather(out, torch.full((3, 4), float(ax.index)), ax)
        rs = torch.empty(2, 4)
        comm.reduce_scatter(rs, torch.ones(2 * ax.size, 4), ax)
        w = comm.all_reduce(torch.ones(5), ax, async_op=True)
        w.wait()
        p = topo.pp
        t = torch.arange(6, dtype=torch.float32)
        if p.index == 0:
            comm.send(t * (topo.rank + 1), p, p.peer(1))
            got = None
        else:
            got = torch.empty(6)
            comm.recv(got, p, p.peer(-1))
    return {"rank": topo.rank, "ar": x.tolist(), "ag": out[:, 0].tolist(), "rs": rs.tolist(),
            "recv": None if got is None else got.tolist(), "events": topo.log.snapshot(),
            "bytes": dict(topo.log.bytes_by_axis), "wire": dict(topo.log.wire_bytes_by_axis)}


def default_device() -> str:
    """torch's default device in this worker (meta under MINI3D_STRICT_DEVICE=1)."""
    return str(torch.get_default_device())


def what_the_launcher_gave(marker: str) -> dict:
    """Print `marker` on stdout and stderr; what the launcher handed this rank (environment,
    path, working directory)."""
    import sys

    print(f"{marker} out of rank {dist.get_rank()}", flush=True)
    print(f"{marker} err of rank {dist.get_rank()}", file=sys.stderr, flush=True)
    return {"env": os.environ.get("MINI3D_TEST_GIVEN"), "path": list(sys.path), "cwd": os.getcwd(),
            "pid": os.getpid(), "ppid": os.getppid()}


def threads_here() -> int:
    """The intra-op threads this rank was given (mini3d.launch.launcher.worker_threads)."""
    return torch.get_num_threads()
