"""Workers of tests/test_moe_train.py (`train_moe`: a MoE model trained by
`mini3d.run.train.Trainer` on a dp group of any size, on a fixed global batch per step, each
replica its slice, in micro-batches) and tests/test_moe_splits.py (`run_moe_cases`: any layout)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mini3d import comm
from mini3d.config import ModelConfig, Plan
from mini3d.grid import Grid, build_topology
from mini3d.run.train import Trainer


def global_batch(step: int, cfg: ModelConfig, n: int = 8, t: int = 16):
    g = torch.Generator(device="cpu").manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab_size, (n, t + 1), generator=g, device="cpu")
    return x[:, :-1], x[:, 1:]


def dp_slice(cfg: ModelConfig, plan: Plan, dp_index: int) -> list:
    """Data-parallel rank `dp_index`'s share of `global_batch(0, cfg)`, in plan.micro_batches
    micro-batches (the one-process reference runs the same slices as its micro-batches)."""
    x, y = global_batch(0, cfg)
    per = x.shape[0] // plan.dp
    xs, ys = x[dp_index * per:(dp_index + 1) * per], y[dp_index * per:(dp_index + 1) * per]
    return list(zip(xs.chunk(plan.micro_batches), ys.chunk(plan.micro_batches)))


def train_moe(cfg: ModelConfig, plan: Plan, steps: int) -> dict:
    """Losses, the averaged flat gradients of each step (after the dp sync), the final
    parameters, expert biases and the step loads."""
    topo = build_topology(Grid(dp=plan.dp), dist.get_rank())
    trainer = Trainer(cfg, plan, topo, seed=3, lr=1e-2)
    grads = []
    trainer.optimizer.grad_hooks.insert(0, lambda local: grads.append(
        torch.cat([g.detach().flatten().double() for _, g in local])))
    losses, loads = [], []
    for step in range(steps):
        mbs = dp_slice(cfg, plan, topo.dp.index)  # the same batch each step: the loss must fall
        losses.append(trainer.mean_loss_over_dp(trainer.step(mbs, step)))
        loads.append(dict(getattr(trainer.net.module, "moe_load", {})))
    module = trainer.net.module
    return {"losses": losses, "grads": grads, "loads": loads,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "biases": {n: b.clone() for n, b in module.named_buffers() if n.endswith("expert_bias")}}


def run_moe_cases(cases: list[dict], steps: int, seed: int) -> list[dict]:
    """tests/test_moe_splits.py: train each case ({"name", "cfg": ModelConfig dict, "plan": Plan
    dict, "grad_clip"}) for `steps` AdamW steps, one `Trainer` after the other in the same
    processes, on `Batches` of the embedded corpus (cp ranks: their zig-zag chunks). Returns from
    every rank with tp = dp = cp = 0 (one per pipeline rank): the losses, each step's full
    gradients of this rank's stages (captured before the inner AdamW step: after the dp, tp and
    pp syncs and clipping), the step loads, and from every rank its expert biases and how many
    parameter elements it holds (ZeRO-3: its shards)."""
    from mini3d.cp import chunk_micro_batches
    from mini3d.data.corpus import Batches, load_tokens
    from mini3d.launch.launcher import current_device
    from tests.threed_workers import _capture_grads, full_grads

    rank, tokens, out = dist.get_rank(), load_tokens(), []
    for case in cases:
        cfg, plan = ModelConfig(**case["cfg"]), Plan(**case["plan"])
        topo = build_topology(Grid(plan.tp, plan.pp, plan.dp, cp=plan.cp, ep=plan.ep), rank,
                              current_device())
        trainer = Trainer(cfg, plan, topo, seed, 3e-3, 0.0, case.get("grad_clip", 0.0))
        seen = _capture_grads(trainer)
        held = sum(p.numel() for chunk in trainer.chunks for p in chunk.parameters())
        batches = Batches(tokens, plan.seq_len, plan.global_batch, seed)
        losses, loads, norms = [], [], []
        for step in range(steps):
            mbs = batches.micro_batches(step, topo.dp.index, plan.dp, plan.micro_batches)
            mbs = chunk_micro_batches(mbs, plan.cp, topo.cp.index)
            losses.append(trainer.mean_loss_over_dp(trainer.step(mbs, step)))
            loads.append(dict(getattr(trainer.net.module, "moe_load", {})))
            norms.append(trainer.last_grad_norm)
        grads = [full_grads(trainer, s) for s in seen]
        biases = {n: b.detach().cpu().clone() for chunk in trainer.chunks
                  for n, b in chunk.named_buffers() if n.endswith("expert_bias")}
        mine = {"name": case["name"], "rank": rank, "biases": biases, "params": held,
                "stage": topo.pp.index}
        state = _state_round_trip(trainer, topo) if case.get("state") else None
        if topo.tp.index == 0 and topo.dp.index == 0 and topo.cp.index == 0:
            mine.update(losses=losses, loads=loads, grads=grads, norms=norms)
            if state is not None:
                mine["state"] = state
        out.append(mine)
        comm.barrier(topo.axes["world"])
    return out


def _state_round_trip(trainer, topo) -> dict:
    """The checkpoint's full state of this rank's stages (mini3d.checkpoint.state: weights and
    AdamW moments by reference name, full shapes), and whether restoring it into the trainer and
    gathering again gives it back bit for bit (collective)."""
    from mini3d.checkpoint.state import gather_full_state, restore_full_state

    weights, moments, step = gather_full_state(trainer.chunks, trainer.optimizer, topo)
    restore_full_state(trainer.chunks, trainer.optimizer, topo, weights, moments, step)
    again, again_m, _ = gather_full_state(trainer.chunks, trainer.optimizer, topo)
    same = all(torch.equal(again[n], w) for n, w in weights.items()) and all(
        torch.equal(again_m[n][k], m) for n, ms in moments.items() for k, m in ms.items())
    return {"weights": weights, "moments": moments, "round_trip": same}
