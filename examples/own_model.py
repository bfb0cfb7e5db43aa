"""mini3d on YOUR model: data parallelism / ZeRO, pipeline stages and tensor parallelism applied to
a network defined here, outside mini3d, and checked against the same network trained unparallelised.

    python examples/own_model.py          # spawns 4 local processes (gloo on CPU); ~30 s

The user's model (`MyNet`) is a plain PyTorch stack of blocks: an input projection, residual MLP
blocks, an output projection, and an MSE loss. Nothing in it knows about mini3d. Then:

* ZeRO-1 and ZeRO-3 over 4 data-parallel ranks: `mini3d.dp.make_dp(model, topo.dp, plan, factory)`
  wraps any nn.Module and builds the sharded optimizer;
* a 2-stage 1F1B pipeline x 2 replicas: `mini3d.pp.generic.stages_from_blocks(model.layers, ...)`
  keeps this rank's blocks, `PipelineRuntime` runs the schedule with the user's loss;
* tensor parallelism x 2 replicas: each residual block is rebuilt from mini3d's parallel layers,
  `ColumnParallelLinear(block.up)` and `RowParallelLinear(block.down)`, sliced from the full layers.

Every layout trains STEPS AdamW steps on the same batches as the reference; the script prints each
layout's largest loss and parameter difference from the reference.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # not needed once installed

from mini3d import comm  # noqa: E402
from mini3d.config import Plan  # noqa: E402
from mini3d.dp import make_dp  # noqa: E402
from mini3d.grid import Grid, build_topology  # noqa: E402
from mini3d.launch.launcher import current_device, launch  # noqa: E402
from mini3d.pp.generic import stages_from_blocks  # noqa: E402
from mini3d.pp.runtime import PipelineRuntime  # noqa: E402
from mini3d.pp.schedules import make_schedule  # noqa: E402
from mini3d.tp import ColumnParallelLinear, RowParallelLinear, unshard_like  # noqa: E402

D_IN, D, HIDDEN, DEPTH = 8, 32, 64, 4
BATCH, STEPS, LR, SEED = 16, 8, 3e-3, 0


# ---- the user's model: plain PyTorch ------------------------------------------------------------
class ResidualMLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class MyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D_IN, D)] + [ResidualMLP(D, HIDDEN) for _ in range(DEPTH)]
                                    + [nn.Linear(D, 1)])

    def forward(self, x, y=None):
        for layer in self.layers:
            x = layer(x)
        return x if y is None else loss_fn(x, y)


def loss_fn(out, y):
    return F.mse_loss(out, y)


def make_model(device="cpu") -> MyNet:
    torch.manual_seed(SEED)  # every rank builds the same initial weights
    with torch.device("cpu"):  # the same draws on every device: initialise on the CPU, then move
        return MyNet().to(device)


def batch(step: int):
    """The global batch of one step: a smooth regression target."""
    g = torch.Generator(device="cpu").manual_seed(1000 + step)
    x = torch.randn(BATCH, D_IN, generator=g, device="cpu")
    return x, torch.sin(x.sum(-1, keepdim=True)) + 0.5 * x[:, :1]


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def my_slice(t, axis):
    """This dp replica's equal share of a global batch tensor."""
    n = t.shape[0] // axis.size
    return t[axis.index * n:(axis.index + 1) * n]


# ---- mini3d applied to it -----------------------------------------------------------------------
def train_dp(topo, zero: int) -> dict:
    """ZeRO over every rank: wrap the whole model (any nn.Module) with make_dp."""
    model = make_model(topo.device)
    net, opt = make_dp(model, topo.dp, Plan(dp=topo.dp.size, zero=zero, global_batch=BATCH), adamw)
    losses = []
    for step in range(STEPS):
        x, y = (my_slice(t, topo.dp).to(topo.device) for t in batch(step))
        loss = net(x, y)  # the mean over this replica's equal share; dp averages the gradients
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_dp_mean(loss.item(), topo))
    return {"losses": losses, "params": net.full_params()}  # full_params: collective under ZeRO-3


def train_pp(topo, micro_batches: int = 2) -> dict:
    """Pipeline: this rank's blocks of the user's stack, the 1F1B schedule, ZeRO-1 over dp."""
    model = make_model(topo.device)
    stages = stages_from_blocks(model.layers, topo.pp.index, topo.pp.size, loss_fn=loss_fn)
    (stage,) = stages.values()
    net, opt = make_dp(stage, topo.dp, Plan(dp=topo.dp.size, zero=1, global_batch=BATCH), adamw)
    b = BATCH // (topo.dp.size * micro_batches)
    runtime = PipelineRuntime(stages, make_schedule("1f1b", topo.pp.size, micro_batches), topo,
                              act_shape=(b, D))
    losses = []
    for step in range(STEPS):
        x, y = (my_slice(t, topo.dp).to(topo.device) for t in batch(step))
        with net.no_sync():  # gradients accumulate over micro-batches; opt.step() syncs them once
            result = runtime.step(list(zip(x.chunk(micro_batches), y.chunk(micro_batches))), step)
        opt.step()
        opt.zero_grad()
        losses.append(_dp_mean(result.loss, topo))
    names = stage.full_names("layers.")
    return {"losses": losses, "params": {names[p]: p.detach().clone() for p in stage.parameters()}}


class TensorParallelResidualMLP(nn.Module):
    """The user's block rebuilt from mini3d's tp layers: `up` keeps this tp_rank's output features,
    `down` the matching input features; the LayerNorm is replicated. Same parameter names."""

    def __init__(self, block: ResidualMLP, tp_axis):
        super().__init__()
        self.norm = block.norm
        self.up = ColumnParallelLinear(block.up, tp_axis)  # f: identity fwd, all-reduce bwd
        self.down = RowParallelLinear(block.down, tp_axis)  # g: all-reduce fwd, identity bwd

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def train_tp(topo) -> dict:
    """Tensor parallelism inside each residual block, plain data parallelism across replicas."""
    model = make_model(topo.device)
    for i, layer in enumerate(model.layers):
        if isinstance(layer, ResidualMLP):
            model.layers[i] = TensorParallelResidualMLP(layer, topo.tp)
    net, opt = make_dp(model, topo.dp, Plan(dp=topo.dp.size, global_batch=BATCH), adamw)
    losses = []
    for step in range(STEPS):
        x, y = (my_slice(t, topo.dp).to(topo.device) for t in batch(step))
        loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_dp_mean(loss.item(), topo))
    return {"losses": losses,
            "params": {n: unshard_like(p, p.detach(), topo) for n, p in model.named_parameters()}}


def _dp_mean(value: float, topo) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=topo.device)
    comm.all_reduce(t, topo.dp, op="avg")
    return float(t.item())


LAYOUTS = {  # name: (tp, pp, dp) of the same 4 ranks, and the function that trains it
    "dp4 zero1": ((1, 1, 4), lambda topo: train_dp(topo, zero=1)),
    "dp4 zero3": ((1, 1, 4), lambda topo: train_dp(topo, zero=3)),
    "pp2 x dp2 1f1b": ((1, 2, 2), train_pp),
    "tp2 x dp2": ((2, 1, 2), train_tp),
}


def worker() -> dict:
    """Runs on every rank: each layout in turn, each with its own process groups."""
    import torch.distributed as dist

    out = {}
    for name, ((tp, pp, dp), fn) in LAYOUTS.items():
        topo = build_topology(Grid(tp, pp, dp), dist.get_rank(), current_device())
        out[name] = fn(topo)
    return out


def reference() -> dict:
    model = make_model()
    opt = adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = model(*batch(step))  # the full global batch in one process
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def compare(results: list[dict]) -> dict:
    """{layout: (max |loss - ref|, max |param - ref|)} with params merged over pipeline ranks."""
    ref, out = reference(), {}
    for name in LAYOUTS:
        params, loss_err = {}, 0.0
        for per_rank in results:
            params.update(per_rank[name]["params"])
            loss_err = max(loss_err, max(abs(a - b) for a, b in zip(per_rank[name]["losses"],
                                                                    ref["losses"])))
        assert sorted(params) == sorted(ref["params"]), name
        out[name] = (loss_err, max(float((params[n] - ref["params"][n]).abs().max()) for n in params))
    out["reference losses"] = ref["losses"]
    return out


def main() -> int:
    report = compare(launch(worker, 4, device="cpu", timeout=300))
    losses = report.pop("reference losses")
    print("reference losses: " + " ".join(f"{v:.4f}" for v in losses))
    print(f"{'layout':<16} {'max |loss diff|':>16} {'max |param diff|':>17}")
    for name, (dl, dw) in report.items():
        print(f"{name:<16} {dl:>16.2e} {dw:>17.2e}")
    ok = all(dl < 1e-5 and dw < 1e-4 for dl, dw in report.values())
    print("all layouts match the unparallelised model" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
