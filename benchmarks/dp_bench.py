"""Step time of mini3d data parallelism against PyTorch's own, on gloo/CPU with dp=2.

    python -m benchmarks.dp_bench [--full]

Pairs, same model (mini3d GPT), same per-rank batch, AdamW, float32:
  * mini3d DataParallel (ZeRO-0, 1 MiB buckets)   vs  torch DistributedDataParallel (1 MiB buckets)
  * mini3d ZeRO-3 (FullyShardedDP, per block)      vs  FSDP2 `fully_shard` on each block + the root

Each repeat times one full step (forward, backward, optimizer step) of every implementation in turn,
interleaved so machine noise hits all alike; rows report min/median/max over repeats, measured on
rank 0. Goals: <= 1.05x DDP, <= 1.10x FSDP2. On a 2-core CPU box with other jobs running the spread
is wide; read the medians. Part of any lead comes from the optimizer: mini3d hands AdamW one flat
tensor per bucket/unit, PyTorch's wrappers leave it one tensor per parameter. If FSDP2 cannot run on CPU/gloo in this torch, its row says why.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

from mini3d.config import ModelConfig, Plan
from mini3d.dp import make_dp
from mini3d.grid import Grid, build_topology
from mini3d.launch.launcher import launch
from mini3d.models.transformer import GPT

from .common import ratio_row

CFG = ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, max_seq_len=64, name="bench")
BATCH, SEQ, SEED = 8, 64, 0


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _ours(topo, zero):
    plan = Plan(dp=topo.dp.size, zero=zero, bucket_mb=1.0)
    net, opt = make_dp(GPT(CFG, SEED), topo.dp, plan, _adamw)
    return net, opt.step, opt.zero_grad


def _ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(GPT(CFG, SEED), bucket_cap_mb=1.0)
    opt = _adamw(net.parameters())
    return net, opt.step, lambda: opt.zero_grad(set_to_none=True)


def _fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = GPT(CFG, SEED)
    for unit in [model.embed, *model.blocks.values(), model.head]:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _adamw(model.parameters())
    return model, opt.step, lambda: opt.zero_grad(set_to_none=True)


def _time_step(impl, x, y):
    net, step, zero_grad = impl
    dist.barrier()
    t0 = time.perf_counter()
    net(x, y).backward()
    step()
    zero_grad()
    return time.perf_counter() - t0


def bench_worker(repeats: int, warmup: int = 2):
    rank = dist.get_rank()
    topo = build_topology(Grid(dp=dist.get_world_size()), rank)
    x, y = _data(rank)
    impls, errors = {"mini3d-dp": _ours(topo, 0), "torch-ddp": _ddp(),
                     "mini3d-zero3": _ours(topo, 3)}, {}
    try:
        impls["torch-fsdp2"] = _fsdp2()
    except Exception as e:  # reported, not hidden
        errors["torch-fsdp2"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    times = {k: [] for k in impls}
    for i in range(warmup + repeats):
        for name, impl in impls.items():
            t = _time_step(impl, x, y)
            if i >= warmup:
                times[name].append(t)
    return {"times": times, "errors": errors}


def run(quick: bool = True) -> list[dict]:
    """Rows comparing step times (dp=2, gloo/CPU); `quick` uses fewer repeats."""
    out = launch(bench_worker, 2, 5 if quick else 20, timeout=600)[0]
    t, rows = out["times"], []
    rows.append(ratio_row("dp=2 DataParallel vs DDP", t["mini3d-dp"], t["torch-ddp"], goal=1.05))
    if "torch-fsdp2" in t:
        rows.append(ratio_row("dp=2 ZeRO-3 vs FSDP2", t["mini3d-zero3"], t["torch-fsdp2"], goal=1.10))
    else:
        rows.append({"name": "dp=2 ZeRO-3 vs FSDP2", "ours_s": statistics.median(t["mini3d-zero3"]),
                     "theirs_s": None, "ratio": None, "note": out["errors"]["torch-fsdp2"]})
    return rows


if __name__ == "__main__":
    for row in run(quick="--full" not in sys.argv):
        print(row)
