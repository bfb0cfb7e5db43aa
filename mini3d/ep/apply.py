"""Expert parallelism applied to a built model.

`apply_ep(module, topo)` runs after the model got its reference values (mini3d.run.train's
`parallelize`): in every MoE layer it keeps this rank's n_experts/ep slice of the stacked expert
weights (`experts.w_*[lo:hi]`, lo = ep index x E/ep: the slice of the same unsharded tensors the
one-process run has), marks them `ep_expert` (the dp wrapper reduces them over edp, not dp x cp:
mini3d.dp.ddp, "Expert parallelism") and routes the layer's expert call through an
`ExpertDispatch` on the ep axis. The router, the shared experts and the expert bias stay whole.
(The full stacked tensors of a stage exist on every rank for a moment, between the reference
initialisation and this slicing; `materialize_reference` draws them whole.)

`gather_experts` / `slice_experts`: between an expert slice and the full stacked tensor, for
checkpoints (mini3d.checkpoint.state saves the full tensors, so any layout resumes from them).

The global gradient norm counts each expert once: `mini3d.tp.clip_grad_norm_` (`ep_expert` pieces).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mini3d import comm
from mini3d.ep.dispatch import ExpertDispatch
from mini3d.models.balance import moe_layers


def expert_slice(n_experts: int, ep: int, index: int) -> slice:
    """The experts rank `index` of an ep group holds."""
    per = n_experts // ep
    return slice(index * per, (index + 1) * per)


@torch.no_grad()
def apply_ep(module: nn.Module, topo) -> None:
    """Keep this ep rank's experts in every MoE layer of `module` and dispatch through ep."""
    ep = topo.ep
    if ep.size == 1:
        return
    for m in moe_layers(module):
        rows = expert_slice(m.cfg.n_experts, ep.size, ep.index)
        for key, p in list(m.experts._parameters.items()):
            if p is None:
                continue
            new = nn.Parameter(p.detach()[rows].clone(), p.requires_grad)
            new.__dict__.update(p.__dict__)  # an expert-tp slice keeps its tp marks (mini3d.tp.experts)
            new.ep_expert = True
            m.experts._parameters[key] = new
        m.dispatch = ExpertDispatch(m.dispatch or m.experts, ep)  # expert-tp: its TPExperts


def gather_experts(p, value: torch.Tensor, topo) -> torch.Tensor:
    """The full stacked tensor (E, ...) of expert slice `p`'s `value` (its weight or a moment;
    all-gathered over ep along dim 0, collective); any other parameter's value as it is."""
    if not getattr(p, "ep_expert", False) or topo.ep.size == 1:
        return value
    value = value.contiguous()
    full = value.new_empty((topo.ep.size * value.shape[0],) + tuple(value.shape[1:]))
    comm.all_gather(full, value, topo.ep)
    return full


def slice_experts(p, full: torch.Tensor, topo) -> torch.Tensor:
    """Inverse of `gather_experts`: this ep rank's rows of a full stacked tensor (no communication)."""
    if not getattr(p, "ep_expert", False) or topo.ep.size == 1:
        return full
    return full[expert_slice(full.shape[0], topo.ep.size, topo.ep.index)]


def is_expert(group) -> bool:
    """Whether a dp wrapper's flat group holds expert slices (its buckets hold one kind)."""
    return any(getattr(p, "ep_expert", False) for p in group.params)


