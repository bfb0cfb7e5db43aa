"""mini3d's pipeline runtime against `torch.distributed.pipelining`, pp = 2 on gloo/CPU.

    python -m benchmarks.pp_torch [--quick] [KIND ...]     # kinds: 1f1b gpipe zb-h1 zbv

Both sides run the same stages of the same GPT (mini3d's `build_stages`, identical weights), the
same m micro-batches of (b, T) token ids and the same schedule: mini3d with `PipelineRuntime`,
PyTorch with `PipelineStage` + `Schedule1F1B` / `ScheduleGPipe`, and for the zero-bubble kinds
(split backward) `ScheduleInterleavedZeroBubble` with one stage per rank (= ZB-H1, whose order
tests/test_pp_zero_bubble.py shows equal to mini3d's zb-h1) and `ScheduleZBVZeroBubble` with two
(the last stage returns logits; mini3d's cross-entropy is the schedule's loss_fn). One timed step
is forward and backward over all micro-batches (no optimizer, gradients zeroed outside the timing), fenced by a
barrier; the two implementations alternate which goes first. Times are rank 0's. If PyTorch's
pipelining cannot run on gloo/CPU in this torch, the row carries the exception as its note.
"""

from __future__ import annotations

import copy
import sys
import time
import traceback

import torch
import torch.distributed as dist

from mini3d import comm
from mini3d.config import ModelConfig
from mini3d.grid import Grid, build_topology
from mini3d.launch.launcher import launch
from mini3d.models.transformer import cross_entropy
from mini3d.pp.partition import build_stages
from mini3d.pp.runtime import PipelineRuntime
from mini3d.pp.schedules import make_schedule
from mini3d.schedule_kinds import schedule_kind

from .common import ratio_row

CFG = ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, max_seq_len=64)
B, T, P = 2, 64, 2  # micro-batch of 2 x 64 tokens, two pipeline ranks


class _LogitsStage(torch.nn.Module):
    """A mini3d stage whose last-stage output is logits (PyTorch's schedule applies the loss)."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x):
        return self.stage(x)  # targets=None: the head returns logits


def _theirs(stages: dict, kind: str, m: int, topo):
    """(modules, PyTorch schedule) over copies of this rank's mini3d stages {stage id: module}."""
    from torch.distributed import pipelining as pl

    n = P * schedule_kind(kind).chunks(1)
    modules = {s: _LogitsStage(copy.deepcopy(q)) for s, q in stages.items()}
    ps = [pl.PipelineStage(q, s, n, torch.device("cpu"), group=topo.pp.group)
          for s, q in sorted(modules.items())]
    if kind in ("1f1b", "gpipe"):
        cls = pl.Schedule1F1B if kind == "1f1b" else pl.ScheduleGPipe
        return torch.nn.ModuleList(modules.values()), cls(ps[0], n_microbatches=m,
                                                          loss_fn=cross_entropy)
    cls = pl.ScheduleInterleavedZeroBubble if kind == "zb-h1" else pl.ScheduleZBVZeroBubble
    return torch.nn.ModuleList(modules.values()), cls(ps, n_microbatches=m, loss_fn=cross_entropy)


def _time(fn, module, axis) -> float:
    module.zero_grad(set_to_none=True)
    comm.barrier(axis)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _worker(kind: str, m: int, repeats: int, warmup: int):
    topo = build_topology(Grid(pp=P), dist.get_rank())
    sched = make_schedule(kind, P, m, schedule_kind(kind).chunks(1))
    stages = build_stages(CFG, 0, topo.pp.index, P, sched.v, placement=sched.placement)
    rt = PipelineRuntime(stages, sched, topo, act_shape=(B, T, CFG.d_model))
    mine = torch.nn.ModuleList(stages.values())
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (m * B, T), generator=g)
    y = torch.randint(0, CFG.vocab_size, (m * B, T), generator=g)
    mbs = list(zip(x.split(B), y.split(B)))
    first = 0 in stages
    last = sched.n_stages - 1 in stages
    impls = {"ours": (lambda: rt.step(mbs, broadcast_loss=False), mine)}
    error = ""
    try:
        module, theirs = _theirs(stages, kind, m, topo)
        args = (x,) if first else ()
        kwargs = {"target": y} if last else {}
        impls["theirs"] = (lambda: theirs.step(*args, **kwargs), module)
        _time(*impls["theirs"], topo.pp)  # fail now (inside the try) if it cannot run here
    except Exception as e:  # reported in the row, not hidden
        impls.pop("theirs", None)
        error = f"{type(e).__name__}: {e}".splitlines()[0][:300] + " | " + \
            traceback.format_exc(limit=2).splitlines()[-2].strip()[:200]
    times = {k: [] for k in impls}
    for i in range(warmup + repeats):
        order = list(impls.items())
        for name, (fn, mod) in (order if i % 2 == 0 else order[::-1]):
            t = _time(fn, mod, topo.pp)
            if i >= warmup:
                times[name].append(t)
    return {"times": times, "error": error}


def run(quick: bool = True, kinds=("1f1b", "gpipe", "zb-h1", "zbv")) -> list[dict]:
    """Rows: mini3d PipelineRuntime vs torch.distributed.pipelining, per schedule, m = 4."""
    rows, m = [], 4
    for kind in kinds:
        out = launch(_worker, P, kind, m, 5 if quick else 20, 2, device="cpu", timeout=300)[0]
        name = f"pp=2 {kind} m={m} mini3d vs torch.distributed.pipelining"
        if "theirs" in out["times"]:
            rows.append(ratio_row(name, out["times"]["ours"], out["times"]["theirs"], goal=1.1,
                                  note=f"fwd+bwd of {m} micro-batches of {B}x{T} tokens"))
        else:
            ours = out["times"]["ours"]
            rows.append({"name": name, "ours_s": sorted(ours)[len(ours) // 2], "theirs_s": None,
                         "ratio": None, "note": "torch pipelining did not run: " + out["error"]})
    return rows


if __name__ == "__main__":
    picked = tuple(a for a in sys.argv[1:] if not a.startswith("--"))  # e.g. zb-h1 zbv
    for r in run(quick="--quick" in sys.argv, **({"kinds": picked} if picked else {})):
        print(r)
