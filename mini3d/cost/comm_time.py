"""Communication time per axis, the cost model's three terms that talk to the links
(`mini3d.cost.model.estimate_cost` adds them to compute): tensor parallelism per micro-batch
(`tp_time`, from the layer's own collectives in `mini3d.tp.layout.comm_per_layer`), data
parallelism / ZeRO per step with the overlap of the last backward (`dp_time`; how many
collectives per step, `dp_collectives`, and their volume in Psi, `zero_traffic_psi`), and context
parallelism's ring per micro-batch with its overlap behind each block's attention (`cp_time`),
and expert parallelism's all-to-alls per micro-batch (`ep_time`, volumes from `mini3d.cost.moe`).
Every collective is timed by `Hardware.collective_s` and sized by `mini3d.comm.ring_wire_bytes`.
"""

from __future__ import annotations

import math

from mini3d.comm import ring_wire_bytes
from mini3d.dp.zero import zero_stage
from mini3d.tp.layout import comm_per_layer
from mini3d.cost.activations import ELEMENT_BYTES, local_seq_len, moe_tokens, ring_block_bytes
from mini3d.cost.params import expert_sharding_degree, head_rank, sharding_degree, stage_layers
from mini3d.cost.moe import a2a_buffer_bytes, a2a_bytes_per_micro_batch, expert_tp_ops, kept_fraction


def members_per_node(plan, hw) -> dict:
    """Per axis: None when its groups stay inside one node, else how many members of one group
    share a node (rank order tp, cp, dp, pp, tp fastest; mini3d.grid): a tp group fills a node
    up to gpus_per_node, a cp or a dp (cp x dp) group has gpus_per_node / tp members per node, a
    pp pair one. A tp group stays in a node while tp <= gpus_per_node, a cp group while tp*cp
    does, a dp group while tp*cp*dp does, pp while the world does.
    Expert parallelism: an ep group is ep consecutive members of dp x cp (in that order, cp
    fastest), so it spans tp*ep ranks and stays in a node while tp*ep <= gpus_per_node; the
    expert-data-parallel group ("edp": the dp*cp/ep ranks holding the same experts) takes every
    ep-th member, gpus_per_node / (tp*ep) of them per node, and spans what dp does."""
    g = hw.gpus_per_node
    span = {"tp": plan.tp, "cp": plan.tp * plan.cp, "dp": plan.tp * plan.cp * plan.dp,
            "pp": plan.world_size, "ep": plan.tp * plan.ep, "edp": plan.tp * plan.cp * plan.dp}
    inner = max(1, g // plan.tp)
    k = {"tp": min(plan.tp, g), "cp": max(1, min(plan.cp, inner)),
         "dp": max(1, min(plan.cp * plan.dp, inner)), "pp": 1,
         "ep": max(1, min(plan.ep, inner)),
         "edp": max(1, min(expert_sharding_degree(plan), g // (plan.tp * plan.ep)))}
    return {a: k[a] if n > g or (g % n != 0 and n > 1) else None for a, n in span.items()}


def tp_time(cfg, plan, hw, layers, bw, stage: int = 0) -> tuple[float, float, float]:
    """(forward seconds, backward seconds, wire bytes) of tp communication per micro-batch on
    pipeline rank `stage` (the first holds the embedding, the last the head and the loss), with
    `plan.expert_tp` each MoE layer's routed-row reduction too (`mini3d.cost.moe.expert_tp_ops`)."""
    t, sb = plan.tp, local_seq_len(plan) * plan.micro_batch_size
    node = members_per_node(plan, hw)["tp"]
    if t == 1:
        return 0.0, 0.0, 0.0
    first, last = stage == 0, stage == head_rank(plan)
    c = comm_per_layer(t, plan.micro_batch_size, local_seq_len(plan), cfg.d_model, plan.sequence_parallel,
                       ELEMENT_BYTES[plan.dtype])

    def seconds(ops):
        return sum(o["count"] * hw.collective_s(o["op"], t, o["bytes"], bw, node) for o in ops)

    redo = plan.recompute == "full"  # the backward runs the forward's collectives again
    act = sb * cfg.d_model * ELEMENT_BYTES[plan.dtype]
    end_s, end_wire = hw.collective_s("all_reduce", t, act, bw, node), ring_wire_bytes("all_reduce", t, act)
    loss = [4 * sb, 8 * sb] if last else []  # cross-entropy: the max, then the two sums (fp32)
    fwd_s = layers * seconds(c["forward"]) + first * end_s + sum(
        hw.collective_s("all_reduce", t, n, bw, node) for n in loss)
    bwd_s = layers * (seconds(c["backward"]) + redo * seconds(c["forward"])) + last * end_s
    wire = (layers * (c["forward_wire_bytes"] * (1 + redo) + c["backward_wire_bytes"])
            + (first + last) * end_wire + sum(ring_wire_bytes("all_reduce", t, n) for n in loss))
    moe = moe_stage_layers(cfg, plan, stage) if plan.expert_tp else 0
    if moe:  # forward ops, their mirror in backward (and the forward's again under full recompute)
        rows = a2a_buffer_bytes(moe_tokens(plan), cfg.d_model, cfg.top_k, ELEMENT_BYTES[plan.dtype],
                                kept_fraction(cfg.capacity_factor))
        ops = expert_tp_ops(rows, t, plan.sequence_parallel)
        fwd_s, bwd_s = fwd_s + moe * seconds(ops), bwd_s + moe * (1 + redo) * seconds(ops)
        wire += moe * (2 + redo) * sum(o["count"] * o["wire_bytes"] for o in ops)
    return fwd_s, bwd_s, wire


def dp_collectives(zero: int, micro_batches: int) -> tuple[int, int]:
    """(gradient reductions, parameter all-gathers) of the whole model one rank issues per
    optimizer step under ZeRO-`zero` with `micro_batches` micro-batches (mini3d.dp.zero,
    "Communication per optimizer step"). ZeRO-0/1 keep full gradients, accumulate the
    micro-batches and reduce once (ZeRO-0 an all-reduce, ZeRO-1 a reduce-scatter); ZeRO-2/3 keep
    only a 1/dp shard, so they reduce-scatter every micro-batch's gradients. ZeRO-1/2 all-gather
    the updated parameters once; ZeRO-3 gathers them for every micro-batch's forward and backward.
    The stage object answers (`mini3d.dp.stage.ZeroStage.collectives_per_step`)."""
    return zero_stage(zero).collectives_per_step(micro_batches)


def zero_traffic_psi(zero: int, micro_batches: int) -> int:
    """Ring volumes one rank sends per step, in Psi: one Psi is a reduce-scatter's or an
    all-gather's share of the full model, (dp-1)/dp of its bytes, and an all-reduce is two (the
    ZeRO paper's accounting, with equal gradient and parameter bytes). With M micro-batches:
    ZeRO-0 and -1 send 2, ZeRO-2 M + 1, ZeRO-3 3M; at M = 1, 2, 2, 2, 3."""
    reductions, gathers = dp_collectives(zero, micro_batches)
    return reductions * (2 if zero_stage(zero).reduce_op == "all_reduce" else 1) + gathers


def dp_time(cfg, plan, hw, n_params, bw, t_bwd, t_compute, n_expert: int = 0,
            expert_bw: float | None = None) -> tuple[float, float, float]:
    """(total seconds, exposed seconds, wire bytes) of data-parallel / ZeRO traffic per step.
    `t_bwd` is one micro-batch's backward, `t_compute` the step's compute. ZeRO-0/1 reduce the
    gradients once, overlapping the last backward; ZeRO-2/3 once per micro-batch (mini3d.dp.zero,
    "Micro-batches under ZeRO-2/3"): each overlaps its own backward, and what outlasts it the
    following forward, except the last micro-batch's. Of the `n_params`, `n_expert` are routed
    experts: reduced (and ZeRO-sharded) over their own expert-data-parallel group
    (`expert_sharding_degree`, on links of `expert_bw`), the rest over cp x dp; the two groups'
    buckets queue one after another on the rank's links."""
    nodes = members_per_node(plan, hw)
    groups = [(n_params - n_expert, sharding_degree(plan), nodes["dp"], bw),
              (n_expert, expert_sharding_degree(plan), nodes["edp"], expert_bw or bw)]
    groups = [gr for gr in groups if gr[0] and gr[1] > 1]
    if not groups:
        return 0.0, 0.0, 0.0
    e = ELEMENT_BYTES[plan.dtype]
    g = ELEMENT_BYTES[plan.grad_dtype] if plan.dtype == "bf16" else e  # fp32 grads by default
    bucket = plan.bucket_mb * 2**20
    g_op = zero_stage(plan.zero).reduce_op
    reductions, gathers = dp_collectives(plan.zero, plan.micro_batches)
    t_reduce = t_last = t_param = wire = 0.0
    for n, d, node, link in groups:
        grads, params = float(n * g), float(n * e)
        n_buckets = max(1, math.ceil(grads / bucket))
        wire += (reductions * ring_wire_bytes(g_op, d, grads)
                 + gathers * ring_wire_bytes("all_gather", d, params))
        # the buckets are issued one after another as the backward produces them, queued in flight
        one = n_buckets * hw.collective_s(g_op, d, grads / n_buckets, link, node)  # one reduction
        t_reduce += one
        t_last = max(t_last, min(one, hw.collective_s(g_op, d, min(bucket, grads), link, node)))
        t_param += gathers * n_buckets * hw.collective_s("all_gather", d, params / n_buckets,
                                                         link, node)
    t_mb = t_compute / plan.micro_batches  # one micro-batch's forward + backward
    exposed = max(t_last, t_reduce - t_bwd) + (reductions - 1) * max(0.0, t_reduce - t_mb)
    if plan.zero == 3:
        per_layer = t_param / max(1, 2 * plan.micro_batches * cfg.n_layers)
        exposed += max(per_layer, t_param - t_compute)
    else:
        exposed += t_param
    return reductions * t_reduce + t_param, exposed, wire


def cp_time(cfg, plan, hw, layers, bw, attn_block_s) -> dict:
    """Ring attention per micro-batch: exposed forward / backward seconds, all transfer seconds and
    wire bytes, given `attn_block_s`, the forward seconds of one block's attention (see above)."""
    cp = plan.cp
    if cp == 1:
        return {"fwd": 0.0, "bwd": 0.0, "total": 0.0, "wire": 0.0}
    kv, acc = ring_block_bytes(cfg, plan), ring_block_bytes(cfg, plan, 4)
    node = members_per_node(plan, hw)["cp"]

    def hop(nbytes):  # one K/V (or accumulator) message to the ring neighbour
        return hw.collective_s("send", 2, nbytes, bw, node and 1)
    fwd_passes = 2 if plan.recompute == "full" else 1
    fwd = fwd_passes * (cp - 1) * max(0.0, hop(kv) - attn_block_s)
    bwd = (cp - 1) * max(0.0, hop(kv + acc) - 2 * attn_block_s) + hop(acc)
    total = (fwd_passes * (cp - 1) + cp - 1) * hop(kv) + cp * hop(acc)
    wire = (fwd_passes * (cp - 1) + cp - 1) * kv + cp * acc
    return {"fwd": layers * fwd, "bwd": layers * bwd, "total": layers * total,
            "wire": layers * wire}


def moe_stage_layers(cfg, plan, stage: int) -> int:
    """MoE layers pipeline rank `stage` holds (all of its chunks)."""
    return sum(cfg.is_moe_layer(i) for i in stage_layers(cfg, plan, stage)) if cfg.n_experts else 0


def ep_wire_bytes(cfg, plan, stage: int = 0) -> float:
    """All-to-all bytes one rank of pipeline rank `stage` sends per micro-batch: four per MoE
    layer (`a2a_bytes_per_micro_batch`, the one formula) for its `moe_tokens`, two more per
    layer under full recompute (the backward runs the forward's dispatch and combine again)."""
    moe, e = moe_stage_layers(cfg, plan, stage), ELEMENT_BYTES[plan.dtype]
    kept, tokens = kept_fraction(cfg.capacity_factor), moe_tokens(plan)
    redo = plan.recompute == "full"
    return (a2a_bytes_per_micro_batch(tokens, cfg.d_model, cfg.top_k, plan.ep, e, moe, kept)
            + redo * a2a_bytes_per_micro_batch(tokens, cfg.d_model, cfg.top_k, plan.ep, e, moe,
                                               kept, backward=False))


def ep_time(cfg, plan, hw, stage: int, bw) -> dict:
    """Expert parallelism per micro-batch on pipeline rank `stage`: forward and backward seconds
    of its MoE layers' all-to-alls (dispatch and combine forward, their gradients backward, the
    forward's again under full recompute), each of `a2a_buffer_bytes` for the rank's
    `moe_tokens`, timed by `Hardware.collective_s("all_to_all", ep, ...)` on the ep group's
    links, and the wire bytes (`ep_wire_bytes`). Not overlapped with compute: Megatron-Core's
    default (its dispatcher waits for each all-to-all; overlapping them with another
    micro-batch's compute is an option there, off by default)."""
    moe = moe_stage_layers(cfg, plan, stage)
    if plan.ep == 1 or not moe:
        return {"fwd": 0.0, "bwd": 0.0, "wire": 0.0}
    e, kept = ELEMENT_BYTES[plan.dtype], kept_fraction(cfg.capacity_factor)
    buffer = a2a_buffer_bytes(moe_tokens(plan), cfg.d_model, cfg.top_k, e, kept)
    one = hw.collective_s("all_to_all", plan.ep, buffer, bw, members_per_node(plan, hw)["ep"])
    redo = plan.recompute == "full"
    return {"fwd": 2 * moe * one, "bwd": (2 + 2 * redo) * moe * one,
            "wire": ep_wire_bytes(cfg, plan, stage)}


__all__ = ["members_per_node", "tp_time", "dp_collectives", "zero_traffic_psi", "dp_time", "cp_time",
           "moe_stage_layers", "ep_wire_bytes", "ep_time"]
