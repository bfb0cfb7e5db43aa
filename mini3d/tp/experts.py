"""Expert tensor parallelism (`Plan.expert_tp`, `--expert-tp`): each MoE layer's routed experts and
its shared experts split over the tp ranks like the dense MLP (Megatron-Core's expert-tp = tp).

`apply_expert_tp(moe, axis, sequence_parallel)` slices one MoE layer (mini3d.models.moe) in place:

    experts.w_gate, w_up  (E, F, d)  rows F/tp of dim 1: column-parallel, silu(gate) * up local
    experts.w_down        (E, d, F)  the matching columns of dim 2: row-parallel, partial sums
    shared.fc/gate/proj              a dense tp MLP (column- then row-parallel, as mlp.*)

Each slice carries `tp_dim` / `tp_index` / `tp_full_size` like every tp shard (mini3d.tp.layers),
so `full_state_dict`, checkpoints, the dp wrapper and `clip_grad_norm_` treat it as one (an
`ep_expert` slice that is also tp-sharded: over tp along F, then over ep along E). The router and
the expert bias stay replicated, and the layer's expert call goes through `TPExperts`:

* without sequence parallelism every tp rank routes the same tokens (its input, the norm's
  output, is replicated), so the routed rows are equal on every tp rank: `f` (copy_to_tp) before
  the local F/tp slices, `g` (all-reduce) of their partial outputs after: the dense MLP's pair,
  on the (rows, d) of the routed token-slots instead of the (B, T, d) activation.
* with sequence parallelism each tp rank routes its own T/tp tokens, as without expert-tp (the
  router, its pooled losses and the replicated gradients' tp sum are unchanged). Then, as in
  Megatron-Core's all-to-all token dispatcher (after its ep exchange, with expert-tp and sequence
  parallelism, which Megatron-Core requires together): the tp group's routed rows are
  all-gathered (each rank's count differs: an all-to-all that sends every member the whole
  block, the count tables gathered first), regrouped by expert, run through this rank's F/tp
  slices, and the partial outputs reduce-scattered back to the rank that routed each row (an
  all-to-all of each member's block, summed). Backward is the mirror: the input rows' gradients
  reduce-scattered, the outputs' all-gathered. Chosen over gathering the sequence before the layer
  (one (B, T, d) all-gather, routing T tokens on every rank): that would route every token tp
  times and give the router whole gradients on each rank among replicated parameters whose
  gradients the trainer sums over tp, and it moves all T tokens where only the routed rows need
  to travel. The shared experts take the sequence path of a dense MLP (their input all-gathered
  along the sequence, their output reduce-scattered).

Under expert parallelism `mini3d.ep.ExpertDispatch` calls `TPExperts` with the rows it received
over ep: the all-to-all moves tokens over ep, and the tp ranks of one ep slice share (or, under
sequence parallelism, exchange) the rows of the same experts.
"""

from __future__ import annotations

import torch

from mini3d import comm
from mini3d.ep.dispatch import _recording_only, all_to_all, by_local_expert
from mini3d.graph_breaks import outside_graphs
from mini3d.tp.layers import _shard, chunk_index
from mini3d.tp.mappings import copy_to_tp, reduce_from_tp


def gather_counts(counts: torch.Tensor, axis) -> torch.Tensor:
    """(tp, E): row j = the rows member j routed to each expert (an all-gather of `counts`)."""
    table = counts.new_empty((axis.size * counts.numel(),))
    comm.all_gather(table, counts.contiguous(), axis)
    if _recording_only(axis):  # the dry run's fake group moves no data (see exchange_counts)
        return counts.repeat(axis.size, 1)
    return table.view(axis.size, -1)


class TPExperts:
    """A MoE layer's local experts with their FFN split over tp (see the module docstring). Not
    a Module: the parameters stay those of `experts`, under the reference's names."""

    def __init__(self, experts, axis, sequence_parallel: bool):
        self.experts, self.axis, self.sequence_parallel = experts, axis, sequence_parallel

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (M, d) sorted by expert, counts (E,): the experts' full outputs, row for row."""
        axis = self.axis
        if not self.sequence_parallel:
            return reduce_from_tp(self.experts(copy_to_tp(rows, axis), counts), axis)
        return _over_the_group(self, rows, counts)


@outside_graphs  # collectives stay outside compiled graphs (mini3d.run.compile, mini3d.graph_breaks)
def _over_the_group(tpx: TPExperts, rows, counts):
    """Sequence parallelism: the tp group's rows gathered, run, reduce-scattered back."""
    axis = tpx.axis
    n, mine = axis.size, rows.shape[0]
    table = gather_counts(counts, axis)  # (tp, E)
    sizes = table.sum(1).tolist()
    got = all_to_all(rows.repeat(n, 1), axis, sizes, [mine] * n)  # every member's rows
    order = by_local_expert(table)
    out = tpx.experts(got[order], table.sum(0))  # partial sums over this rank's F/tp
    back = all_to_all(out[torch.argsort(order)], axis, [mine] * n, sizes)  # (tp * mine, d)
    return back.view(n, mine, rows.shape[1]).sum(0)  # the reduce-scatter's sum, in member order



@torch.no_grad()
def apply_expert_tp(moe, axis, sequence_parallel: bool, parallelize_mlp) -> None:
    """Split MoE layer `moe`'s routed experts (and, by `parallelize_mlp`, the dense-MLP split of
    mini3d.tp.parallelize, its shared experts) over tp; see the module docstring."""
    tp, experts = axis.size, moe.experts
    for key, dim in (("w_gate", 1), ("w_up", 1), ("w_down", 2)):
        full = experts._parameters.get(key)
        if full is None:
            continue
        index = [chunk_index(full.shape[dim], tp, r) for r in range(tp)]
        experts._parameters[key] = _shard(full, dim, index, axis.index, full.shape[dim])
    if moe.shared is not None:
        parallelize_mlp(moe.shared, axis, sequence_parallel)
        moe.shared_by_sequence = sequence_parallel  # its gather / scatter need the (B, T, d) dims
    moe.dispatch = TPExperts(experts, axis, sequence_parallel)


__all__ = ["apply_expert_tp", "TPExperts", "gather_counts"]
