"""Workers of tests/test_ep.py: MoE models trained by `mini3d.run.train.Trainer` under expert
parallelism (and the one-process reference), several cases in one launch.

Each case is (cfg, plan, steps, grad_clip). Every rank feeds its dp slice of a fixed global batch
(in `plan.micro_batches` micro-batches), and returns the mean losses, every step's gradients at
full shape by reference name (after the dp / edp reduction, before clipping; expert slices
gathered over ep), the grad norms, the final full parameters, the expert biases, the loads, and
the rank's model-state ledger (`mini3d.dp.model_state_ledger`) with its count of flat groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mini3d import comm
from mini3d.dp import model_state_ledger
from mini3d.grid import Grid, build_topology
from mini3d.run.train import Trainer
from tests.moe_workers import dp_slice


def _full(topo, p, t: torch.Tensor) -> torch.Tensor:
    """The full stacked tensor of an expert slice (gathered over ep along dim 0), else `t`."""
    t = t.detach().double().contiguous()
    if not getattr(p, "ep_expert", False) or topo.ep.size == 1:
        return t.clone()
    out = t.new_empty((topo.ep.size * t.shape[0],) + tuple(t.shape[1:]))
    comm.all_gather(out, t, topo.ep)
    return out


def _named_grads(trainer) -> dict:
    module = trainer.net.module
    params = dict(module.named_parameters())
    return {n: _full(trainer.topo, params[n], g) for n, g in sorted(trainer.net.full_grads().items())}


def train_case(cfg, plan, steps: int, grad_clip: float = 0.0) -> dict:
    grid = Grid(dp=plan.dp, ep=plan.ep)
    topo = build_topology(grid, dist.get_rank())
    trainer = Trainer(cfg, plan, topo, seed=3, lr=1e-2, grad_clip=grad_clip)
    grads = []
    trainer.optimizer.grad_hooks.insert(0, lambda local: grads.append(_named_grads(trainer)))
    losses, loads, norms = [], [], []
    for step in range(steps):
        mbs = dp_slice(cfg, plan, topo.dp.index)
        losses.append(trainer.mean_loss_over_dp(trainer.step(mbs, step)))
        loads.append(dict(getattr(trainer.net.module, "moe_load", {})))
        norms.append(trainer.last_grad_norm)
    module = trainer.net.module  # (ZeRO-3: its parameters are gathered only while they compute)
    params = dict(module.named_parameters())
    return {"losses": losses, "grads": grads, "loads": loads, "norms": norms,
            "params": {n: _full(topo, params[n], v) for n, v in trainer.net.full_params().items()},
            "biases": {n: b.clone() for n, b in module.named_buffers() if n.endswith("expert_bias")},
            "a2a": topo.log.count("ep", "all_to_all"), "ep_wire": topo.log.wire_bytes_by_axis["ep"],
            "ledger": model_state_ledger(trainer.net, trainer.optimizer),
            "groups": len(trainer.optimizer.shards)}


def train_cases(cases: list) -> list:
    return [train_case(*case) for case in cases]


def a2a_checks() -> dict:
    """`comm.all_to_all` with uneven splits on the whole job as one ep group, traced; the differentiable
    version's backward; a bad split list refused before anything is issued."""
    from mini3d.comm import DeviceMismatch
    from mini3d.ep import all_to_all

    topo = build_topology(Grid(dp=dist.get_world_size(), ep=dist.get_world_size()), dist.get_rank())
    ep, r, n = topo.ep, topo.ep.index, topo.ep.size
    send = [r + j + 1 for j in range(n)]  # rank r sends r + j + 1 rows to member j
    recv = [j + r + 1 for j in range(n)]  # and receives j + r + 1 rows from member j
    x = torch.cat([torch.full((k, 3), 100.0 * r + j, device="cpu") for j, k in enumerate(send)])
    x.requires_grad_(True)
    y = all_to_all(x, ep, recv, send)
    (y * torch.arange(1.0, y.shape[0] + 1, device="cpu")[:, None]).sum().backward()
    ev = [e for e in topo.log.events if e.op == "all_to_all"]
    out = {"y": y.detach()[:, 0].tolist(), "grad": x.grad[:, 0].tolist(),
           "events": [(e.axis, e.seq, e.shape, e.bytes, e.wire_bytes, e.splits) for e in ev],
           "bytes": topo.log.bytes_by_axis["ep"], "wire": topo.log.wire_bytes_by_axis["ep"]}
    try:
        comm.all_to_all(torch.zeros(n, 3, device="cpu"), torch.zeros(n + 1, 3, device="cpu"), ep,
                        [1] * n, [1] * n)
    except ValueError as e:
        out["bad_splits"] = str(e)
    try:
        comm.all_to_all(torch.zeros(3, 2, device="meta"), torch.zeros(3, 2, device="cpu"), ep)
    except DeviceMismatch as e:
        out["device"] = str(e)
    out["after"] = len([e for e in topo.log.events if e.op == "all_to_all"])
    return out


def a2a_and_cases(cases: list) -> tuple:
    """`a2a_checks` then `train_cases` in one launch."""
    return a2a_checks(), train_cases(cases)
