"""One rank's share of the model under a plan: the ordered transforms from the reference model
(pipeline stages, tensor and expert parallelism, the attention core, compile and recomputation,
data parallelism / ZeRO with its optimizer). `mini3d.run.train.Trainer` calls `parallelize`."""

from __future__ import annotations

import torch.nn as nn

from mini3d.config import ModelConfig, Plan
from mini3d.cp import apply_cp
from mini3d.dp import make_dp
from mini3d.ep import apply_ep
from mini3d.models.attention import set_attention
from mini3d.models.balance import pool_router_stats_over, step_load
from mini3d.pp.partition import build_stages
from mini3d.pp.schedules import placement_of
from mini3d.recompute import apply_recompute
from mini3d.run.compile import apply_compile
from mini3d.tp import apply_tp, materialize_reference


def parallelize(cfg: ModelConfig, plan: Plan, topo, seed: int, optimizer_factory):
    """The ordered transforms that turn the reference model into this rank's share of it:

    1. pipeline: build only this pp rank's stages (v chunks for interleaved), on the meta device
       (shapes, no memory);
    2. tensor parallelism: slice each stage's matrices for this tp rank (still shapes), then give
       each slice its value on this rank's device: the slice of the same parameter of the full
       reference model (one full parameter in host memory at a time, never the unsliced stage);
    2b. expert parallelism: keep this ep rank's slice of every MoE layer's experts (mini3d.ep);
    3. the attention core (written out, or torch's fused sdpa; ring attention over cp when cp > 1),
       each block's torch.compile (`plan.compile`, mini3d.run.compile), the recomputation policy;
    4. data parallelism / ZeRO over the cp x dp ranks (the dp axis when cp = 1; expert slices over
       edp), which also builds the optimizer.

    Returns ({stage id: module}, the dp wrapper, the optimizer)."""
    stages = build_stages(cfg, seed, topo.pp.index, plan.pp, plan.virtual_stages, device="meta",
                          placement=placement_of(plan.schedule))
    for module in stages.values():
        apply_tp(module, topo, plan)
        materialize_reference(module, topo, seed, topo.device)
        apply_ep(module, topo)  # ep > 1: this rank's slice of each MoE layer's experts
        set_attention(module, plan.attention)
        apply_cp(module, topo, plan.attention)
        # the router losses' statistics summed over the ranks splitting a micro-batch's tokens
        pool_router_stats_over(module, [(topo.tp, 1)] * plan.sequence_parallel
                               + [(topo.cp, topo.cp.size)])
        apply_recompute(apply_compile(module, plan), plan.recompute)
    chunks = [stages[s] for s in sorted(stages)]
    root = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
    net, optimizer = make_dp(root, topo.dp_cp, plan, optimizer_factory,  # experts over edp (ep > 1)
                             expert_axis=topo.edp if plan.ep > 1 else None)  # then the expert load
    # (each layer's summed over the ranks that split its tokens; the report over the stages too)
    sp_tp = topo.tp if plan.sequence_parallel else None
    optimizer.grad_hooks.append(lambda _: setattr(root, "moe_load", step_load(
        root, topo.dp_cp, token_group=sp_tp, stages=topo.pp, cfg=cfg)))
    return stages, net, optimizer
