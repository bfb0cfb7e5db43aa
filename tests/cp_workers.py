"""Worker functions for tests/test_cp.py and tests/test_cp_train.py (spawned by mini3d.launch.launcher)."""

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
    return [torch.randn(SHAPE, generator=g, device="cpu") for _ in range(4)]


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


def _groups_only(grid: Grid):
    """On a rank outside `grid` (a case smaller than the job): take part in creating its groups
    (torch's new_group is collective over the whole job), in build_topology's order."""
    names = ("tp", "cp", "pp", "dp", "mp", "embedding") + (("dp_cp",) if grid.sizes["cp"] > 1 else ())
    for name in names:
        for g in grid.groups(name):
            if len(g) > 1:
                dist.new_group(g)


def run_cp_layouts(cases: list[dict], cfg_dict: dict, steps: int, seed: int) -> list[dict]:
    """tests/threed_workers.run_layouts for layouts with a cp axis: each case ({"name", "plan"})
    trains a Trainer on its plan.world_size ranks (the others only help build the groups), feeding
    each cp rank its zig-zag chunks; returns from every dp_rank-0, cp_rank-0 rank the losses, every
    step's full gradients and the final parameters (gathered over cp x dp, tp)."""
    from mini3d import comm
    from mini3d.checkpoint.store import gather_full_state
    from mini3d.config import ModelConfig, Plan
    from mini3d.cp import chunk_batch
    from mini3d.data.corpus import Batches, load_tokens
    from mini3d.run.train import Trainer
    from tests.threed_workers import LR, WEIGHT_DECAY, _capture_grads, full_grads

    cfg, rank, out = ModelConfig(**cfg_dict), dist.get_rank(), []
    tokens = load_tokens()
    for case in cases:
        plan = Plan(**case["plan"])
        grid = Grid(plan.tp, plan.pp, plan.dp, cp=plan.cp)
        if rank >= plan.world_size:
            _groups_only(grid)
            dist.barrier()
            continue
        topo = build_topology(grid, rank)
        trainer = Trainer(cfg, plan, topo, seed, LR, WEIGHT_DECAY)
        seen = _capture_grads(trainer)
        batches = Batches(tokens, plan.seq_len, plan.global_batch, seed)
        losses = []
        for step in range(steps):
            mbs = batches.micro_batches(step, topo.dp.index, plan.dp, plan.micro_batches)
            mbs = [chunk_batch(x, y, plan.cp, topo.cp.index) for x, y in mbs]
            losses.append(trainer.mean_loss_over_dp(trainer.step(mbs, step)))
        grads = [full_grads(trainer, s) for s in seen]
        weights, _, opt_step = gather_full_state(trainer.chunks, trainer.optimizer, topo)
        if topo.dp.index == 0 and topo.cp.index == 0:
            out.append({"name": case["name"], "coords": topo.coords, "losses": losses,
                        "grads": grads, "weights": weights, "opt_step": opt_step,
                        "cp_sends": topo.log.count("cp", "send")})
        comm.barrier(topo.axes["world"])
    return out


def measured_ring(spec: dict) -> dict:
    """`mini3d.run.train.train_worker` on `spec`, reduced to what tests/test_cp_costs.py compares: this
    rank's activation bytes of layer 0 per micro-batch, and its cp sends of step 1 (count, bytes)."""
    from mini3d.run.train import train_worker

    r = train_worker(spec)
    sends = [e for e in r["events"] if e["axis"] == "cp" and e["op"] == "send"
             and e["context"].get("step") == 1]
    return {"coords": r["coords"], "layer0": sum(v for k, v in r["activations"].items()
                                                 if k.startswith("layer0.")),
            "sends": len(sends), "send_bytes": sum(e["bytes"] for e in sends)}
