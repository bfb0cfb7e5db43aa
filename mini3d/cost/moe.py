"""Expert parallelism's traffic: the one owner of the all-to-all volume formula.

With `ep` ranks sharing one MoE layer's experts, every token-slot (a token routed to one of its
top_k experts) whose expert lives on another rank of the ep group crosses the wire twice in the
forward, as a row of d_model values: once to its expert (dispatch) and once back (combine), and
twice again in the backward (the gradients of those two all-to-alls, the same sizes reversed).
Under balanced routing a slot's expert is on another rank with probability (ep - 1) / ep, so one
rank sends, per MoE layer and micro-batch, in each of the four all-to-alls,

    tokens x top_k x (ep - 1) / ep x d_model x element bytes

(Megatron-Core's and DeepSpeed-MoE's accounting; GShard, Lepikhin et al. 2020, section 3.2). A
token counted once instead of top_k times, or the local share (1 / ep) counted as traffic, are the
two usual slips (exercises/a2a_volume.py's grader checks both). With a capacity factor the
dropped slots stay home: `kept` is the fraction of slots kept (1.0 dropless).

Node-limited routing (DeepSeek-V3: a token uses at most route_topk_groups groups, one node
each) bounds the nodes a token reaches: `nodes_reached` counts them by running the real router,
`internode_bytes` turns them into the bytes that cross between nodes.

Expert tensor parallelism (`--expert-tp`, mini3d.tp.experts) adds, per MoE layer and
micro-batch, the tp reduction of the routed rows' partial outputs (`expert_tp_ops`): without
sequence parallelism one all-reduce of the rank's rows forward (`g`) and one of their gradients
backward (`f`); with it the tp group's rows all-gathered and the partials reduce-scattered
forward, the mirror backward.

The estimator, the time model, the dry run, the course's figures and the grader call these
functions; none keeps a copy of the formula.
"""

from __future__ import annotations

from mini3d.comm import ring_wire_bytes

A2A_PER_LAYER = 4  # dispatch and combine, forward and backward, per MoE layer per micro-batch


def a2a_buffer_bytes(tokens: int, d_model: int, top_k: int, element_bytes: int,
                     kept: float = 1.0) -> float:
    """Bytes of one all-to-all's whole buffer on one rank: a row of d_model values for every kept
    token-slot of its `tokens` local tokens, the slots whose expert is local included (what the
    dispatch permutes into, and what the combine receives back)."""
    return tokens * top_k * kept * d_model * element_bytes


def a2a_bytes(tokens: int, d_model: int, top_k: int, ep: int, element_bytes: int,
              kept: float = 1.0) -> float:
    """Bytes one rank sends in ONE all-to-all (dispatch or combine, forward or backward) of one
    MoE layer for `tokens` local tokens, under balanced routing (see the module docstring): the
    (ep - 1) / ep of `a2a_buffer_bytes` bound for the other ep ranks."""
    if ep <= 1:
        return 0.0
    return a2a_buffer_bytes(tokens, d_model, top_k, element_bytes, kept) * (ep - 1) / ep


def kept_fraction(capacity_factor: float) -> float:
    """Share of token-slots kept under balanced routing: every expert is offered tokens * top_k /
    E slots and keeps ceil(C * tokens * top_k / E) (mini3d.models.moe.capacity), so min(1, C);
    1.0 dropless (C = 0). Skewed routing drops more, never keeps more."""
    return min(1.0, capacity_factor) if capacity_factor else 1.0


def a2a_bytes_per_micro_batch(tokens: int, d_model: int, top_k: int, ep: int,
                              element_bytes: int, moe_layers: int, kept: float = 1.0,
                              backward: bool = True) -> float:
    """Bytes one rank sends in all the all-to-alls of one micro-batch over `moe_layers` MoE
    layers: four per layer with backward (A2A_PER_LAYER), two in a forward-only pass."""
    per = A2A_PER_LAYER if backward else A2A_PER_LAYER // 2
    return per * moe_layers * a2a_bytes(tokens, d_model, top_k, ep, element_bytes, kept)


def experts_per_rank(n_experts: int, ep: int) -> int:
    """Routed experts one ep rank holds (ep divides n_experts: Plan.problems checks it)."""
    return n_experts // ep


# ----------------------------------------------------------------------------- node-limited routing

def nodes_reached(n_experts: int, top_k: int, nodes: int, groups: int = 1, topk_groups: int = 1,
                  tokens: int = 8192, seed: int = 0) -> dict:
    """How many nodes one token's top_k experts sit on, with the E experts spread over `nodes`
    nodes in order (expert e on node e // (E / nodes); DeepSeek-V3 puts each of its 8 groups on
    one node) and routed by the real router (`mini3d.models.routers.GroupedSigmoidRouter`:
    groups=1 is plain top-k; else the best `topk_groups` of `groups` groups, node-limited
    routing) on random scores (`tokens` tokens of standard-normal logits, seeded; no bias, so
    every expert is equally likely: balanced routing). Returns {"mean": distinct nodes per token,
    "max": the most any token reached, "remote": distinct nodes other than the token's own per
    token (its source node drawn uniformly, so a reached node is its own with probability
    1 / nodes)}. A token crosses to each remote node once when the dispatch sends it node by
    node and forwards it inside the node (DeepSeek-V3's all-to-all: `internode_bytes`)."""
    import torch

    from mini3d.models.routers import GroupedSigmoidRouter

    if n_experts % nodes or n_experts % groups:
        raise ValueError(f"n_experts={n_experts} must split evenly over nodes={nodes} and "
                         f"groups={groups}")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, n_experts, generator=g)
    router = GroupedSigmoidRouter(groups, topk_groups, 1.0, True)
    _, experts, _ = router.route(logits, top_k, torch.zeros(n_experts))
    node = experts // (n_experts // nodes)  # (tokens, k)
    hit = torch.zeros(tokens, nodes, dtype=torch.bool).scatter_(1, node, True).sum(1).double()
    return {"mean": hit.mean().item(), "max": int(hit.max()), "remote": hit.mean().item() * (nodes - 1) / nodes}


def internode_bytes(tokens: int, d_model: int, element_bytes: int, rows_per_token: float) -> float:
    """Bytes one node's `tokens` tokens send to other nodes in ONE all-to-all when each token
    crosses as `rows_per_token` rows of d_model values: `nodes_reached(...)["remote"]` when the
    dispatch sends a token once per node, top_k * (nodes - 1) / nodes when it sends every
    token-slot on its own (`a2a_bytes`'s count with ep = nodes)."""
    return tokens * rows_per_token * d_model * element_bytes


def expert_tp_ops(rows_bytes: float, tp: int, sequence_parallel: bool) -> list[dict]:
    """The collectives one MoE layer's routed experts issue under expert-tp in ONE direction
    (forward; the backward issues the mirror image: the same ops, gather and scatter swapped), for
    a rank whose routed rows hold `rows_bytes` (`a2a_buffer_bytes` of its tokens). Each op as
    `mini3d.tp.layout.comm_per_layer` lists them: {"op", "count", "bytes" (the payload as
    mini3d.comm logs it), "wire_bytes" (per rank)}. Under sequence parallelism the gathered
    payload is the tp group's rows, tp x `rows_bytes` (balanced routing)."""
    if tp <= 1:
        return []
    if sequence_parallel:
        full = rows_bytes * tp
        return [{"op": op, "count": 1, "bytes": full, "wire_bytes": ring_wire_bytes(op, tp, full)}
                for op in ("all_gather", "reduce_scatter")]
    return [{"op": "all_reduce", "count": 1, "bytes": rows_bytes,
             "wire_bytes": ring_wire_bytes("all_reduce", tp, rows_bytes)}]
