"""ZeRO stage 3: parameters sharded too, gathered one unit (layer) at a time.

The model is cut into *units*: each direct child module that holds parameters, with ModuleDict /
ModuleList containers opened up (for `mini3d.model.GPT`: the embedding, every block, the head). Each
unit's parameters live in one padded flat buffer (see `buckets.py`); the rank keeps only its shard
`lo:hi` of it (`unit.shard`) and a gradient shard of the same size. The full buffer exists only
while the unit computes:

    forward   pre-hook: all-gather the unit (waiting for its prefetch), start the async all-gather
              of the next unit (prefetch), run; post-hook: free the full buffer.
    backward  a hook on the unit's output fires just before the unit's backward: all-gather again
              and prefetch the unit before it (the next one backward meets). When every parameter's
              gradient has arrived (post-accumulate hooks), reduce-scatter(avg) the gradients into
              the shard (added, so several synchronised micro-batches accumulate) and free.

Freeing keeps the storage object and resizes it to 0 bytes; gathering resizes it back and fills it.
The parameters are views of that storage, so tensors autograd saved in forward (e.g. `weight.t()`)
see the gathered values again in backward. The collective writes through the flat buffer, whose
version counter is not the parameters' (each parameter's `.data` was re-pointed, keeping its own),
so autograd's saved-tensor version checks are not tripped.

Unit order: prefetch follows registration order, which for GPT is also execution order.

Micro-batches: every micro-batch gathers each unit twice (forward, backward). Under `no_sync()` the
gradients accumulate in full-size `p.grad` tensors and are reduce-scattered once, at the synchronising
micro-batch or in `finish_grad_sync()`; without it each micro-batch reduce-scatters into the shard.
"""

from __future__ import annotations


import torch
import torch.nn as nn

from .. import comm
from .buckets import FlatGroup, param_names
from .ddp import GradSyncWrapper


def find_units(module: nn.Module) -> list[nn.Module]:
    """The modules to gather as one piece: children with parameters, containers opened up."""
    if any(True for _ in module.parameters(recurse=False)):
        raise ValueError(f"{type(module).__name__} holds parameters directly; ZeRO-3 gathers per "
                         f"child module, so wrap those parameters in a submodule")
    units = []
    for child in module.children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList, nn.Sequential)):
            units += find_units(child)
        elif any(p.requires_grad for p in child.parameters()):
            units.append(child)
    return units


def tied_units(units: list[nn.Module]) -> list[list[nn.Module]]:
    """The units as groups gathered together: a unit sharing a parameter with an earlier one (a
    head tied to the embedding) joins that unit's group, so the shared tensor has one shard and one
    gradient; the group is gathered for each of its modules' forwards and stays gathered in
    backward until the shared gradient (complete after the earlier module's backward) arrives."""
    groups: list[list[nn.Module]] = []
    owner: dict = {}
    for unit in units:
        found = next((owner[p] for p in unit.parameters() if p in owner), None)
        if found is None:
            found = len(groups)
            groups.append([])
        groups[found].append(unit)
        for p in unit.parameters():
            owner.setdefault(p, found)
    return groups


class FullyShardedDP(GradSyncWrapper):
    """ZeRO-3 over `dp_axis`: each rank stores 1/dp of every unit's parameters and gradients."""

    stage = 3

    def __init__(self, module: nn.Module, dp_axis, param_dtype: torch.dtype | None = None):
        super().__init__()
        self.module, self.axis = module, dp_axis
        self.units = tied_units(find_units(module))
        first = next(module.parameters())
        self.param_dtype = param_dtype or first.dtype
        self.groups, self._group_of = [], {}
        n, idx = dp_axis.size, dp_axis.index
        for i, mods in enumerate(self.units):
            params = {p: None for m in mods for p in m.parameters() if p.requires_grad}  # once each
            g = FlatGroup(i, list(params), n, idx)
            fp32 = g.flatten(torch.float32, first.device)
            g.master_init = None if self.param_dtype == torch.float32 else fp32[g.lo:g.hi].clone()
            g.shard = fp32[g.lo:g.hi].to(self.param_dtype).clone()
            g.full = torch.empty(g.padded, dtype=self.param_dtype, device=first.device)
            g.adopt(g.full)
            g.grad_shard = torch.zeros_like(g.shard)
            g.state, g.work, g.bwd_ready = "full", None, False
            self._free(g)
            self.groups.append(g)
            for p in g.params:
                self._group_of[p] = g
                p.register_post_accumulate_grad_hook(self._on_grad)
            for unit in mods:
                unit.register_forward_pre_hook(lambda m, a, g=g: self._pre_forward(g))
                unit.register_forward_hook(lambda m, a, out, g=g: self._post_forward(g, out))
        self.require_sync = True
        self._works: list = []

    # ---- gather / free ---------------------------------------------------------------------
    def _gather(self, g: FlatGroup, wait: bool = True):
        if g.state == "free":
            g.full.untyped_storage().resize_(g.padded * g.full.element_size())
            g.work = comm.all_gather(g.full, g.shard, self.axis, async_op=True)
            g.state = "gathering"
        if wait and g.state == "gathering":
            g.work.wait()
            g.work, g.state = None, "full"

    def _free(self, g: FlatGroup):
        if g.state == "gathering":
            g.work.wait()
        g.full.untyped_storage().resize_(0)
        g.work, g.state = None, "free"

    def _prefetch(self, i: int):
        if 0 <= i < len(self.groups):
            self._gather(self.groups[i], wait=False)

    # ---- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, g: FlatGroup):
        self._gather(g)
        self._prefetch(g.index + 1)

    def _post_forward(self, g: FlatGroup, out):
        self._free(g)
        if torch.is_grad_enabled():
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, g=g: self._pre_backward(g))
        return out

    def _pre_backward(self, g: FlatGroup):
        if not g.bwd_ready:
            g.bwd_ready = True
            self._gather(g)
            self._prefetch(g.index - 1)

    def _on_grad(self, p: torch.Tensor):
        g = self._group_of[p]
        g.ready += 1
        if g.ready < len(g.params):
            return
        g.ready, g.bwd_ready = 0, False
        if self.require_sync:
            self._reduce(g)
        self._free(g)

    def _reduce(self, g: FlatGroup):
        flat = torch.zeros(g.padded, dtype=self.param_dtype, device=g.shard.device)
        for p, v in g.views(flat):
            if p.grad is not None:
                v.copy_(p.grad)
                p.grad = None
        out = torch.empty_like(g.grad_shard)
        work = comm.reduce_scatter(out, flat, self.axis, op="avg", async_op=True)
        self._works.append((work, lambda g=g, out=out, flat=flat: g.grad_shard.add_(out)))

    def finish_grad_sync(self):
        """Reduce-scatter gradients still held in full size (no_sync windows), wait for all."""
        for g in reversed(self.groups):  # the order backward would have used, on every rank
            if any(p.grad is not None for p in g.params):
                self._reduce(g)
            g.ready, g.bwd_ready = 0, False
            self._free(g)
        for work, finish in self._works:
            work.wait()
            finish()
        self._works = []

    def zero_grad(self):
        for g in self.groups:
            g.grad_shard.zero_()
            for p in g.params:
                p.grad = None

    # ---- optimizer / ledger / tests ----------------------------------------------------------
    def shard_groups(self) -> list:
        return [(g, g.shard, lambda g=g: g.grad_shard) for g in self.groups]

    def after_step(self):
        """Nothing to gather: the next forward gathers each unit from its updated shard."""

    def state_tensors(self) -> dict:
        return {"parameters": [g.shard for g in self.groups] + [g.full for g in self.groups],
                "gradients": [g.grad_shard for g in self.groups]}

    def _gathered(self, shard: torch.Tensor, g: FlatGroup) -> torch.Tensor:
        full = torch.empty(g.padded, dtype=shard.dtype, device=shard.device)
        comm.all_gather(full, shard, self.axis)
        return full

    def full_params(self) -> dict:
        names = param_names(self.module)
        return {names[p]: v.clone() for g in self.groups
                for p, v in g.views(self._gathered(g.shard, g))}

    def full_grads(self) -> dict:
        names = param_names(self.module)
        return {names[p]: v.clone() for g in self.groups
                for p, v in g.views(self._gathered(g.grad_shard, g))}
