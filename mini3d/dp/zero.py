"""One entry point for data parallelism and ZeRO stages 0-3, with optional bf16 mixed precision.

    model, opt = make_dp(module, topo.dp, plan, lambda params: torch.optim.AdamW(params, lr=3e-4))
    for step in ...:
        for i, (x, y) in enumerate(micro_batches):
            ctx = model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
            with ctx:
                (model(x, y) / len(micro_batches)).backward()
        opt.step()        # finishes the gradient sync, steps this rank's shard, re-gathers params
        opt.zero_grad()

`ShardedOptimizer` wraps any elementwise torch.optim optimizer (AdamW, Adam, SGD...). It hands the
inner optimizer one *master* tensor per flat group: this rank's shard of it (the whole group for
stage 0). Because the optimizer sees flat shards, per-tensor rules (LAMB trust ratios, Adafactor
factorisation) would see the wrong tensors: only elementwise optimizers are exact.

Memory per parameter with Adam (Psi parameters, Nd = dp), as the ledger measures it (g = gradient
bytes: 4 with bf16 parameters and the default fp32 gradients, 2 with `grad_dtype=bf16`, the ZeRO
paper's accounting):

    stage   bf16 params + grads + fp32 master + Adam    float32
    0       2 + g + 12          (= 16 for g = 2)        4 + 4 + 8           = 16
    1       2 + g + 12/Nd                               4 + 4 + 8/Nd
    2       2 + (g + 12)/Nd                             4 + (4 + 8)/Nd
    3       (2 + g + 12)/Nd                             (4 + 4 + 8)/Nd

In float32 the master *is* the parameter shard (a view, no extra bytes). In bf16 the model computes
with bf16 parameters; autograd's bf16 gradients are accumulated and reduced in float32 (ddp.py,
"Gradient dtype"), so the fp32 gradient shard is the master's gradient as it is (with
`grad_dtype=bf16` the collectives carry bf16 and the master gets an fp32 copy of the bf16 shard);
the new master is rounded back into the bf16 parameters. The masters start from the exact fp32
initial values.

Micro-batches under ZeRO-2/3: a rank can only keep 1/dp of the gradients if the other ranks'
contributions leave it before the next micro-batch adds more, so ZeRO-2 and ZeRO-3 reduce-scatter
every micro-batch's gradients (bucket by bucket, overlapping that micro-batch's backward) and add
them into the shard, ignoring `no_sync()`: a rank holds its shard plus the buckets in flight
(`buckets.transient_grad_bytes`) whatever the micro-batch count, and sends micro_batches times the
reduce-scatter volume. The alternative, accumulating full gradients under no_sync and reducing once
(what the pipeline runtime asks for), holds the whole model's gradients plus the shard: more than
ZeRO-0 (1.57x measured on `small`, dp=2, 4 micro-batches). What the references do:
- DeepSpeed ZeRO-2/3 reduce after every backward, accumulation boundary or not ("each rank retains
  only the accumulated gradients of its partition", deepspeedai/DeepSpeed#2252), and its pipeline
  engine allows ZeRO-1 only, because pipelines need many micro-batches (DeepSpeed#4164).
- FSDP2 reduce-scatters every micro-batch by default, keeping sharded gradients;
  `set_requires_gradient_sync(False)` accumulates unsharded ones instead, trading memory for
  traffic (pytorch/pytorch#126166).
- Megatron-Core's distributed optimizer keeps the full fp32 grad buffer, accumulates the
  micro-batches into it and reduce-scatters once at the last one: it does not shard gradients
  ("[no] distribute model gradients", 6 + 12/d bytes per parameter: docs/distrib_optimizer) and
  is mini3d's ZeRO-1 in memory.
Stages 0/1 keep the full buffers anyway and synchronise once per step (ddp.py).

Communication per optimizer step: each stage says which collective reduces the gradients, how
often, and how the parameters come back (stage.py, `ZeroStage.collectives_per_step`); the traffic
in Psi (a reduce-scatter's or all-gather's (n-1)/n share of the model, an all-reduce two) is
`mini3d.cost.comm_time.zero_traffic_psi`, the one owner, which chapter 03 shows measured. Psi is
the padded size (see buckets.py); the comm log rounds each op's wire bytes down to an integer, so
the measured total is the sum of the per-op floors.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mini3d.dp.zero0 import Zero0
from mini3d.dp.zero1 import Zero1
from mini3d.dp.zero2 import Zero2
from mini3d.dp.zero3 import Zero3

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "float64": torch.float64}
STAGES = {s.number: s for s in (Zero0(), Zero1(), Zero2(), Zero3())}  # the ZeRO stages, by number


def zero_stage(number: int):
    """The strategy object of ZeRO stage `number` (stage.py: what it shards, reduces, gathers)."""
    if number not in STAGES:
        raise ValueError(f"zero={number} is not a ZeRO stage (choose 0, 1, 2 or 3)")
    return STAGES[number]


class ShardedOptimizer:
    """step()/zero_grad() over the shards a DataParallel / FullyShardedDP wrapper exposes."""

    def __init__(self, wrapper, optimizer_factory):
        self.wrapper = wrapper
        self.shards = wrapper.shard_groups()  # [(group, param shard view, grad shard getter)]
        self.masters = []
        for group, pshard, _ in self.shards:
            if pshard.dtype in (torch.float32, torch.float64):
                master = nn.Parameter(pshard)  # shares storage with the parameters
            else:
                master = nn.Parameter(group.master_init)
                group.master_init = None
            self.masters.append(master)
        self.inner = optimizer_factory(self.masters)
        # f([(flat group, its local gradient)]) after the dp sync, before the update; changes in place
        # (the trainer sums sequence-parallel gradients over tp here: tp.sum_replicated_grads)
        self.grad_hooks: list = []

    @property
    def param_groups(self):
        return self.inner.param_groups

    def step(self):
        self.wrapper.finish_grad_sync()
        local = [(group, grad_of()) for group, _, grad_of in self.shards]
        for hook in self.grad_hooks:
            hook(local)
        meter = self.wrapper.meter
        for i, ((_, g), master) in enumerate(zip(local, self.masters)):
            master.grad = g if g.dtype == master.dtype else g.float()
            if master.grad is not g:
                meter.hold(("master", i), master.grad)  # bf16 reduction: an fp32 copy for the step
        self.inner.step()
        with torch.no_grad():
            for (group, pshard, _), master in zip(self.shards, self.masters):
                if master.data_ptr() != pshard.data_ptr():
                    pshard.copy_(master)  # round the fp32 master into the bf16 parameters
        self.wrapper.after_step()

    def zero_grad(self):
        self.wrapper.zero_grad()
        for i, m in enumerate(self.masters):
            m.grad = None
            self.wrapper.meter.release(("master", i))

    def state_tensors(self) -> dict:
        """Master weights and optimizer state, by ledger category."""
        states, scalars = [], []
        for m in self.masters:
            for v in self.inner.state.get(m, {}).values():
                if isinstance(v, torch.Tensor):
                    (states if v.numel() == m.numel() else scalars).append(v)
        return {"master_weights": list(self.masters), "optimizer_states": states,
                "optimizer_scalars": scalars}


def make_dp(module: nn.Module, dp_axis, plan, optimizer_factory, expert_axis=None):
    """(wrapped module, optimizer) for `plan.zero` in 0-3 and `plan.dtype` over `dp_axis`.

    The wrapper has forward, no_sync(), finish_grad_sync(), full_params(), full_grads(); the
    optimizer has step() and zero_grad(). `module` may be a whole model, a pipeline stage or a
    tensor-parallel shard: only its local parameters are synchronised over the dp axis; the expert
    slices of expert parallelism (`ep_expert`) over `expert_axis` (edp; ddp.py, zero3.py)."""
    stage = zero_stage(plan.zero)
    grad = getattr(plan, "grad_dtype", "float32")
    for name, value in (("dtype", plan.dtype), ("grad_dtype", grad)):
        if value not in DTYPES:
            raise ValueError(f"{name}={value!r} is unknown (choose {', '.join(DTYPES)})")
    dtype, grad_dtype = DTYPES[plan.dtype], DTYPES[grad] if plan.dtype == "bf16" else None
    wrapper = stage.wrap(module, dp_axis, param_dtype=dtype, grad_dtype=grad_dtype,
                         bucket_mb=plan.bucket_mb, expert_axis=expert_axis)
    return wrapper, ShardedOptimizer(wrapper, optimizer_factory)
