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

Gradients: each hook adds the gradient autograd produced into the unit's flat accumulation buffer
`unit.acc` (float32 for bf16 parameters by default, see ddp.py's "Gradient dtype") and drops p.grad.
The buffer is allocated at the unit's first gradient, after the reductions of earlier units have
completed, and freed when its own reduce-scatter completes: at most GRAD_BUCKETS_IN_FLIGHT units'
full gradients are alive during a synchronised backward (`buckets.transient_grad_bytes`).

Freeing keeps the storage object and resizes it to 0 bytes; gathering resizes it back and fills it.
The parameters are views of that storage, so tensors autograd saved in forward (e.g. `weight.t()`)
see the gathered values again in backward. The collective writes through the flat buffer, whose
version counter is not the parameters' (each parameter's `.data` was re-pointed, keeping its own),
so autograd's saved-tensor version checks are not tripped.

Unit order: prefetch follows registration order, which for GPT is also execution order.

Micro-batches: every micro-batch gathers each unit twice (forward, backward). Under `no_sync()` the
gradients accumulate in the units' full-size `acc` buffers and are reduce-scattered once, at the
synchronising micro-batch or in `finish_grad_sync()`; without it each micro-batch reduce-scatters
into the shard.
"""

from __future__ import annotations


import torch
import torch.nn as nn

from .. import comm
from .buckets import GRAD_BUCKETS_IN_FLIGHT, FlatGroup, param_names
from .ddp import GradSyncWrapper
from .ledger import GradMeter


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

    def __init__(self, module: nn.Module, dp_axis, param_dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype | None = None):
        super().__init__()
        self.module, self.axis = module, dp_axis
        self.units = tied_units(find_units(module))
        first = next(module.parameters())
        self.param_dtype = param_dtype or first.dtype
        self.grad_dtype = grad_dtype or self.param_dtype
        self.meter = GradMeter()
        self.groups, self._group_of = [], {}
        n, idx = dp_axis.size, dp_axis.index
        for i, mods in enumerate(self.units):
            params = {p: None for m in mods for p in m.parameters() if p.requires_grad}  # once each
            g = FlatGroup(i, list(params), n, idx)
            wide = torch.float64 if self.param_dtype == torch.float64 else torch.float32
            fp32 = g.flatten(wide, first.device)  # float64 runs: float64 masters
            g.master_init = None if self.param_dtype == wide else fp32[g.lo:g.hi].clone()
            g.shard = fp32[g.lo:g.hi].to(self.param_dtype).clone()
            g.full = torch.empty(g.padded, dtype=self.param_dtype, device=first.device)
            g.adopt(g.full)
            g.grad_shard = torch.zeros(g.shard_numel, dtype=self.grad_dtype, device=first.device)
            self.meter.hold(("shard", i), g.grad_shard)
            g.acc, g.shard_clean = None, True  # full-size gradient buffer; shard still zero
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
        if p.grad is not None:
            self._accumulator(g, p).add_(p.grad)
            p.grad = None
        g.ready += 1
        if g.ready < len(g.params):
            return
        g.ready, g.bwd_ready = 0, False
        if self.require_sync:
            self._reduce(g)
        self._free(g)

    def _accumulator(self, g: FlatGroup, p: torch.Tensor) -> torch.Tensor:
        """`p`'s view of the unit's gradient buffer, allocated (zero) at the unit's first gradient
        once earlier units' reductions have completed."""
        if g.acc is None:
            self._drain(GRAD_BUCKETS_IN_FLIGHT - 1)
            g.acc = torch.zeros(g.padded, dtype=self.grad_dtype, device=g.shard.device)
            self.meter.hold(("acc", g.index), g.acc)
        return g.view_of(g.acc, p)

    def _reduce(self, g: FlatGroup):
        flat, g.acc = g.acc, None  # from now on only the collective (and `finish`) hold it
        direct = g.shard_clean  # nothing to add to: reduce straight into the shard
        out = g.grad_shard if direct else torch.empty_like(g.grad_shard)
        self.meter.hold(("out", g.index), None if direct else out)
        work = comm.reduce_scatter(out, flat, self.axis, op="avg", async_op=True)

        def finish(g=g, out=out):
            if not direct:
                g.grad_shard.add_(out)
            g.shard_clean = False
            self.meter.release(("acc", g.index))
            self.meter.release(("out", g.index))
        self._works.append((work, finish))

    def _drain(self, limit: int):
        """Wait for and finish the oldest reduce-scatters until at most `limit` are pending (each
        frees its unit's full gradient buffer)."""
        while len(self._works) > limit:
            work, finish = self._works.pop(0)
            work.wait()
            finish()

    def finish_grad_sync(self):
        """Reduce-scatter gradients still held in full size (no_sync windows), wait for all."""
        for g in reversed(self.groups):  # the order backward would have used, on every rank
            if g.acc is not None:
                self._reduce(g)
            g.ready, g.bwd_ready = 0, False
            self._free(g)
        self._drain(0)

    def zero_grad(self):
        for g in self.groups:
            g.grad_shard.zero_()
            g.shard_clean = True
            for p in g.params:
                p.grad = None

    # ---- optimizer / ledger / tests ----------------------------------------------------------
    def shard_groups(self) -> list:
        return [(g, g.shard, lambda g=g: g.grad_shard) for g in self.groups]

    def after_step(self):
        """Nothing to gather: the next forward gathers each unit from its updated shard."""

    def state_tensors(self) -> dict:
        return {"parameters": [g.shard for g in self.groups] + [g.full for g in self.groups],
                "gradients": [g.grad_shard for g in self.groups] +
                             [g.acc for g in self.groups if g.acc is not None]}

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
