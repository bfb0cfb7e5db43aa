"""Workers of tests/test_moe_train.py: a MoE model trained by `mini3d.run.train.Trainer` on a dp
group of any size, on a fixed global batch per step (each replica its slice, in micro-batches)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mini3d.config import ModelConfig, Plan
from mini3d.grid import Grid, build_topology
from mini3d.run.train import Trainer


def global_batch(step: int, cfg: ModelConfig, n: int = 8, t: int = 16):
    g = torch.Generator(device="cpu").manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab_size, (n, t + 1), generator=g, device="cpu")
    return x[:, :-1], x[:, 1:]


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
        x, y = global_batch(0, cfg)  # the same batch each step: the loss must fall
        per = x.shape[0] // plan.dp
        r = topo.dp.index
        xs, ys = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        mbs = list(zip(xs.chunk(plan.micro_batches), ys.chunk(plan.micro_batches)))
        losses.append(trainer.mean_loss_over_dp(trainer.step(mbs, step)))
        loads.append(dict(getattr(trainer.net.module, "moe_load", {})))
    module = trainer.net.module
    return {"losses": losses, "grads": grads, "loads": loads,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "biases": {n: b.clone() for n, b in module.named_buffers() if n.endswith("expert_bias")}}
