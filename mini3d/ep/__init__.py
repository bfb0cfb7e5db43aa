"""Expert parallelism (`--ep N`): the routed experts of every MoE layer split over N ranks carved
out of dp x cp (mini3d.grid's ep and edp groups); tokens reach their experts and come back by
all-to-all (dispatch.py), the expert slices are cut from the reference weights and their
gradients reduced over edp (apply.py, mini3d.dp.ddp)."""

from mini3d.ep.apply import (apply_ep, expert_slice, gather_experts, is_expert,
                             slice_experts)
from mini3d.ep.dispatch import ExpertDispatch, all_to_all, exchange_counts

__all__ = ["ExpertDispatch", "all_to_all", "apply_ep", "exchange_counts",
           "expert_slice", "gather_experts", "is_expert", "slice_experts"]
