"""ZeRO stage 3: parameters sharded too, gathered one unit (layer) at a time.

The model is cut into *units*: each direct child module that holds parameters, with ModuleDict /
ModuleList containers opened up (for `mini3d.models.transformer.GPT`: the embedding, every block, the head). A
unit's parameters are cut, in reverse registration order like ddp.py's buckets, into *pieces* of at
most `bucket_mb` (`buckets.split_into_buckets`); each piece lives in one padded flat buffer (a
`FlatGroup`, see `buckets.py`) of which the rank keeps only its shard `lo:hi` (`piece.shard`) and a
gradient shard of the same size. The full buffers exist only while the unit computes:

    forward   pre-hook: all-gather the unit's pieces (waiting for its prefetch), start the async
              all-gather of the next unit (prefetch), run; post-hook: free the full buffers.
    backward  a hook on the unit's output fires just before the unit's backward: all-gather again
              and prefetch the unit before it (the next one backward meets). When every gradient
              of a piece has arrived (post-accumulate hooks), reduce-scatter(avg) them into the
              piece's shard (in place, then added, so the micro-batches accumulate); when the whole
              unit's have, free it.

Gradients: each hook adds the gradient autograd produced into its piece's flat accumulation buffer
`piece.acc` (float32 for bf16 parameters by default, see ddp.py's "Gradient dtype") and drops
p.grad. The buffer is allocated at the piece's first gradient, once fewer than
GRAD_BUCKETS_IN_FLIGHT earlier pieces' reductions are pending, and freed when its own
reduce-scatter completes: at most GRAD_BUCKETS_IN_FLIGHT pieces' full gradients are alive
(`buckets.transient_grad_bytes`), a couple of buckets' worth rather than a whole block's (a block of
`small` is 16% of its gradients: 1/dp + 16% would leave ZeRO-3 at 0.66x ZeRO-0's peak on dp=2).

Freeing keeps the storage object and resizes it to 0 bytes; gathering resizes it back and fills it.
The parameters are views of that storage, so tensors autograd saved in forward (e.g. `weight.t()`)
see the gathered values again in backward. The collective writes through the flat buffer, whose
version counter is not the parameters' (each parameter's `.data` was re-pointed, keeping its own),
so autograd's saved-tensor version checks are not tripped.

Unit order: prefetch follows registration order, which for GPT is also execution order.

Micro-batches: every micro-batch gathers each unit twice (forward, backward) and reduce-scatters
its gradients into the shard as soon as they are complete, `no_sync()` or not, so no unit's full
gradient outlives its reduction at any micro-batch count (why: zero.py, "Micro-batches under
ZeRO-2/3"); `finish_grad_sync()` reduces what is left (a piece some parameter got no gradient in).

Expert parallelism (`expert_axis`, edp): a unit's expert slices (`ep_expert`) get pieces of their
own (`buckets.runs_by_axis`), sharded, gathered and reduce-scattered over edp (`piece.axis`; dense
pieces over dp x cp), each gradient multiplied by `piece.prescale` (1/ep, the one formula of
ddp.py's expert buckets) before the edp average. A piece whose group has one member (edp when
ep = dp x cp) is kept whole (`piece.whole`): its shard is its full buffer, never freed or gathered.
"""

from __future__ import annotations


import torch
import torch.nn as nn

from mini3d import comm
from mini3d.dp.buckets import (GRAD_BUCKETS_IN_FLIGHT, FlatGroup, InFlight, param_names,
                               runs_by_axis, split_into_buckets)
from mini3d.dp.ddp import GradSyncWrapper
from mini3d.dp.ledger import GradMeter
from mini3d.dp.stage import ZeroStage


class Zero3(ZeroStage):
    """ZeRO-3: everything sharded; each unit gathered for its forward and again for its backward,
    its gradients reduce-scattered into the shard every micro-batch (`FullyShardedDP` below)."""

    number = 3
    shards = ("optimizer_states", "gradients", "parameters")
    reduce_op = "reduce_scatter"
    reduces_every_micro_batch = True
    param_gather = "per_unit"

    def wrap(self, module: nn.Module, dp_axis, param_dtype=None, grad_dtype=None,
             bucket_mb: float = 1.0, expert_axis=None) -> "FullyShardedDP":
        return FullyShardedDP(module, dp_axis, param_dtype=param_dtype, grad_dtype=grad_dtype,
                              bucket_mb=bucket_mb, expert_axis=expert_axis)


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


class Unit:
    """Modules gathered together (`tied_units`) and the pieces their parameters live in."""

    def __init__(self, index: int, pieces: list[FlatGroup]):
        self.index, self.pieces = index, pieces
        self.n_params = sum(len(g.params) for g in pieces)
        self.state, self.works = "full", []  # "free" | "gathering" (works pending) | "full"
        self.ready, self.bwd_ready = 0, False  # gradients arrived; backward gather done


class FullyShardedDP(GradSyncWrapper):
    """ZeRO-3 over `dp_axis`: each rank stores 1/dp of every unit's parameters and gradients
    (of its expert slices 1/|edp|, over `expert_axis`)."""

    stage = 3
    strategy = Zero3()

    def __init__(self, module: nn.Module, dp_axis, param_dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype | None = None, bucket_mb: float = 1.0, expert_axis=None):
        super().__init__()
        self.module, self.axis = module, dp_axis
        first = next(module.parameters())
        self.param_dtype = param_dtype or first.dtype
        self.grad_dtype = grad_dtype or self.param_dtype
        self.meter = GradMeter()
        self.groups, self.units, self._group_of, self._unit_of = [], [], {}, {}
        for i, mods in enumerate(tied_units(find_units(module))):
            params = {p: None for m in mods for p in m.parameters() if p.requires_grad}  # once each
            runs = [(axis, scale, r) for axis, scale, run in
                    runs_by_axis(list(reversed(params)), dp_axis, expert_axis)
                    for r in split_into_buckets(run, int(bucket_mb * 2**20))]  # one axis a piece
            unit = Unit(i, [self._piece(len(self.groups) + k, r, first.device, axis, scale)
                            for k, (axis, scale, r) in enumerate(runs)])
            self.groups += unit.pieces
            self.units.append(unit)
            self._free(unit)
            for g in unit.pieces:
                for p in g.params:
                    self._group_of[p], self._unit_of[p] = g, unit
                    p.register_post_accumulate_grad_hook(self._on_grad)
            for m in mods:
                m.register_forward_pre_hook(lambda m, a, u=unit: self._pre_forward(u))
                m.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out))
        self.require_sync = True
        self.in_flight = InFlight()  # the pieces' reduce-scatters, in issue order

    def _piece(self, index: int, params: list, device, axis, prescale: float) -> FlatGroup:
        g = FlatGroup(index, params, axis.size, axis.index)
        g.axis, g.prescale, g.whole = axis, prescale, axis.size == 1
        wide = torch.float64 if self.param_dtype == torch.float64 else torch.float32
        fp32 = g.flatten(wide, device)  # float64 runs: float64 masters
        g.master_init = None if self.param_dtype == wide else fp32[g.lo:g.hi].clone()
        g.shard = fp32[g.lo:g.hi].to(self.param_dtype).clone()
        g.full = g.shard if g.whole else torch.empty(g.padded, dtype=self.param_dtype, device=device)
        g.adopt(g.full)
        g.grad_shard = torch.zeros(g.shard_numel, dtype=self.grad_dtype, device=device)
        self.meter.hold(("shard", index), g.grad_shard)
        g.acc = None  # full-size gradient buffer, while the piece's gradients arrive
        return g

    # ---- gather / free ---------------------------------------------------------------------
    def _gather(self, u: Unit, wait: bool = True):
        if u.state == "free":
            cut = [g for g in u.pieces if not g.whole]
            for g in cut:
                g.full.untyped_storage().resize_(g.padded * g.full.element_size())
            u.works = [comm.all_gather(g.full, g.shard, g.axis, async_op=True) for g in cut]
            u.state = "gathering"
        if wait and u.state == "gathering":
            for w in u.works:
                w.wait()
            u.works, u.state = [], "full"

    def _free(self, u: Unit):
        for w in u.works:  # a prefetch still in flight
            w.wait()
        for g in u.pieces:
            if not g.whole:
                g.full.untyped_storage().resize_(0)
        u.works, u.state = [], "free"

    def _prefetch(self, i: int):
        if 0 <= i < len(self.units):
            self._gather(self.units[i], wait=False)

    # ---- hooks -------------------------------------------------------------------------------
    def _pre_forward(self, u: Unit):
        self._gather(u)
        self._prefetch(u.index + 1)

    def _post_forward(self, u: Unit, out):
        self._free(u)
        if torch.is_grad_enabled():
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._pre_backward(u))
        return out

    def _pre_backward(self, u: Unit):
        if not u.bwd_ready:
            u.bwd_ready = True
            self._gather(u)
            self._prefetch(u.index - 1)

    def _on_grad(self, p: torch.Tensor):
        g, u = self._group_of[p], self._unit_of[p]
        if p.grad is not None:
            self._accumulator(g, p).add_(p.grad)
            p.grad = None
        g.ready += 1
        if g.ready == len(g.params):  # every micro-batch, no_sync or not ("Micro-batches")
            g.ready = 0
            self._reduce(g)
        u.ready += 1
        if u.ready == u.n_params:
            u.ready, u.bwd_ready = 0, False
            self._free(u)

    def _accumulator(self, g: FlatGroup, p: torch.Tensor) -> torch.Tensor:
        """`p`'s view of its piece's gradient buffer, allocated (zero) at the piece's first
        gradient once earlier pieces' reductions have completed."""
        if g.acc is None:
            self.in_flight.drain(GRAD_BUCKETS_IN_FLIGHT - 1)
            g.acc = torch.zeros(g.padded, dtype=self.grad_dtype, device=g.shard.device)
            self.meter.hold(("acc", g.index), g.acc)
        return g.view_of(g.acc, p)

    def _reduce(self, g: FlatGroup):
        flat, g.acc = g.acc, None  # from now on only the collective (and `finish`) hold it
        if g.prescale != 1.0:  # expert piece: the edp average, divided by dp*cp (module docstring)
            flat.mul_(g.prescale)
        # in place, into this rank's slice of the buffer (as ddp.py's stage 2): no output buffer
        work = comm.reduce_scatter(flat[g.lo:g.hi], flat, g.axis, op="avg", async_op=True)

        def finish(g=g, flat=flat):
            g.grad_shard.add_(flat[g.lo:g.hi])
            self.meter.release(("acc", g.index))
        self.in_flight.add(work, finish)  # its finish frees the piece's full gradient buffer

    def finish_grad_sync(self):
        """Reduce-scatter gradients still held in full size (a piece not complete), wait for all."""
        for u in reversed(self.units):  # the order backward would have used, on every rank
            for g in u.pieces:
                if g.acc is not None:
                    self._reduce(g)
                g.ready = 0
            u.ready, u.bwd_ready = 0, False
            self._free(u)
        self.in_flight.drain(0)

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
                "gradients": [g.grad_shard for g in self.groups] +
                             [g.acc for g in self.groups if g.acc is not None]}

    def _gathered(self, shard: torch.Tensor, g: FlatGroup) -> torch.Tensor:
        full = torch.empty(g.padded, dtype=shard.dtype, device=shard.device)
        comm.all_gather(full, shard, g.axis)
        return full

    def full_params(self) -> dict:
        names = param_names(self.module)
        return {names[p]: v.clone() for g in self.groups
                for p, v in g.views(self._gathered(g.shard, g))}

    def full_grads(self) -> dict:
        names = param_names(self.module)
        return {names[p]: v.clone() for g in self.groups
                for p, v in g.views(self._gathered(g.grad_shard, g))}
