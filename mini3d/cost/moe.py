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
