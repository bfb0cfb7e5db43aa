"""Data parallelism with bucketed gradient synchronisation that overlaps backward (ZeRO stages 0-2).

`DataParallel(module, dp_axis, stage)` keeps whatever parameters `module` holds (a whole model, a
pipeline stage or a tensor-parallel shard) in flat buckets, filled in *reverse* registration order:
backward produces the last layers' gradients first, so the first bucket fills early. A
`register_post_accumulate_grad_hook` on every parameter counts arrivals; as soon as a bucket is
complete its collective is launched asynchronously on the dp axis while backward continues with the
earlier layers. Buckets are launched strictly in order so every rank issues the same collectives in
the same sequence. `finish_grad_sync()` waits for them all.

What is held, which collective a full bucket launches, and how the parameters come back are the
`stage`'s answers (a `BucketStage`, see stage.py): ZeRO-0 all-reduces into the persistent buffer
(zero0.py), ZeRO-1 reduce-scatters it in place (zero1.py), ZeRO-2 reduce-scatters a transient
buffer into a persistent shard, every micro-batch, with at most `buckets.GRAD_BUCKETS_IN_FLIGHT`
full buffers alive (zero2.py). This module holds what they share: the buckets, the hooks, the
launch order and the collectives in flight (`buckets.InFlight`).

Gradient dtype (`grad_dtype`, Plan.grad_dtype): with bf16 parameters the gradients are accumulated
and reduced in float32 by default, as Megatron-LM and FSDP do: each bf16 gradient is added into a
float32 bucket buffer and dropped, so micro-batch sums and the dp average are not rounded to 8 bits
each time, and the fp32 shard feeds the fp32 master without a copy; the price is 4 instead of 2
bytes per gradient element, in memory and on the wire (`grad_dtype=bf16`: halves, rounded).

`meter` (a `ledger.GradMeter`) follows every gradient buffer allocated and freed here: `peak` bytes.

Expert parallelism (`expert_axis`): the parameters marked `ep_expert` (a MoE layer's expert
slices, mini3d.ep) are held by one edp group only, so they get buckets of their own, tagged with
that axis (`FlatGroup.axis`; the others carry `dp_axis`): their collective runs on edp and ZeRO
shards them over edp (one wrapper, one launch order, one meter; each stage reads `b.axis`).
Divisor: a rank's expert gradient already sums its whole ep group's tokens (the combine's
backward brought them), so the global-batch mean is the edp sum over dp*cp, not over |edp|: an
expert bucket is scaled by |edp| / |dp x cp| = 1/ep (`b.prescale`) before its edp average.

Averaging: the collective divides the sum by dp. With the caller scaling each micro-batch loss by
1/micro_batches, the result equals the single-process gradient of the mean loss over the global batch.

Gradient accumulation: a stage that keeps full gradient buffers (0/1) reduces once per step: inside
`no_sync()` the hooks do nothing and autograd accumulates straight into the bucket views; run every
micro-batch but the last under it: one collective per bucket per step (a second synchronised
backward before `finish_grad_sync` is an error). A stage that reduces every micro-batch (2) ignores
`no_sync()` (why: zero.py, "Micro-batches under ZeRO-2/3").
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from mini3d import comm
from mini3d.dp.buckets import FlatGroup, InFlight, param_names, runs_by_axis, split_into_buckets
from mini3d.dp.ledger import GradMeter
from mini3d.dp.stage import ZeroStage
from mini3d.timeline_clock import clock_for, seconds_of


class GradSyncWrapper(nn.Module):
    """What every data-parallel wrapper shares: `forward` runs the wrapped `self.module`, and
    `no_sync()` accumulates gradients locally (no communication) for the backward passes inside."""

    require_sync = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old


class BucketStage(ZeroStage):
    """A ZeRO stage whose parameters live in `DataParallel`'s flat buckets (0-2): the defaults are
    ZeRO-0's and ZeRO-1's (a persistent full gradient buffer per bucket); each stage overrides
    what differs (its collective in `launch`, its shards, its parameter gather)."""

    def wrap(self, module: nn.Module, dp_axis, param_dtype=None, grad_dtype=None,
             bucket_mb: float = 1.0, expert_axis=None) -> "DataParallel":
        return DataParallel(module, dp_axis, self, bucket_mb, param_dtype, grad_dtype, expert_axis)

    def allocate_grads(self, dp: "DataParallel", b: FlatGroup, device):
        """The bucket's persistent gradient storage: here the full buffer (p.grad views of it)."""
        b.grad_buf = torch.zeros(b.padded, dtype=dp.grad_dtype, device=device)
        dp.meter.hold(("buf", b.index), b.grad_buf)

    def grad_buffer(self, dp: "DataParallel", b: FlatGroup) -> torch.Tensor:
        """The full buffer a gradient is added into (here the persistent one)."""
        return b.grad_buf

    def launch(self, dp: "DataParallel", b: FlatGroup):
        """Issue the complete bucket's collective: (async work, finish callback or None)."""
        raise NotImplementedError

    def held_grads(self, b: FlatGroup) -> torch.Tensor:
        """The persistent gradient tensor the ledger charges."""
        return b.grad_buf

    def param_shard(self, b: FlatGroup) -> torch.Tensor:
        return b.param_buf[b.lo:b.hi]

    def grad_shard(self, b: FlatGroup) -> torch.Tensor:
        return b.grad_buf[b.lo:b.hi]

    def zero_grads(self, dp: "DataParallel", b: FlatGroup):
        b.grad_buf.zero_()

    def gather_params(self, dp: "DataParallel"):
        """After the optimizer updated this rank's shards (here: parameters not sharded)."""

    def full_grad(self, dp: "DataParallel", b: FlatGroup) -> torch.Tensor:
        """The bucket's averaged gradient at full (padded) size (collective: all-gathers shards)."""
        shard = self.grad_shard(b)
        full = torch.empty(b.padded, dtype=shard.dtype, device=shard.device)
        comm.all_gather(full, shard.clone(), b.axis)
        return full


class DataParallel(GradSyncWrapper):
    """Bucketed, overlapped gradient sync of `module`'s local parameters over `dp_axis` (expert
    slices over `expert_axis`), as the ZeRO `stage` (a `BucketStage`: 0, 1 or 2) says."""

    def __init__(self, module: nn.Module, dp_axis, stage: BucketStage, bucket_mb: float = 1.0,
                 param_dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None,
                 expert_axis=None):
        super().__init__()
        if not isinstance(stage, BucketStage):
            raise ValueError(f"DataParallel handles the flat-bucket ZeRO stages 0, 1 or 2, got {stage!r}")
        self.module, self.axis, self.strategy, self.stage = module, dp_axis, stage, stage.number
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("module has no trainable parameters")
        self.param_dtype = param_dtype or params[0].dtype
        self.grad_dtype = grad_dtype or self.param_dtype
        separate = self.grad_dtype != self.param_dtype  # p.grad cannot view the buffers
        self._views = not stage.shards_gradients and not separate  # p.grad views the full buffer
        self.meter = GradMeter()
        device = params[0].device
        self.buckets = []
        for axis, prescale, run in runs_by_axis(list(reversed(params)), dp_axis, expert_axis):
            n, idx = stage.shard_of(axis)
            for r in split_into_buckets(run, int(bucket_mb * 2**20)):
                b = FlatGroup(len(self.buckets), r, n, idx)
                b.axis, b.prescale = axis, prescale
                self.buckets.append(b)
        # one replica whose p.grad are views of the buckets has nothing to reduce or move: no
        # hooks (their Python, per parameter and step, is a few percent of a small model's step)
        hooked = any(b.axis.size > 1 or b.prescale != 1.0 for b in self.buckets) or not self._views
        self._bucket_of = {}
        for b in self.buckets:
            wide = torch.float64 if self.param_dtype == torch.float64 else torch.float32
            fp32 = b.flatten(wide, device)  # exact initial values, for the master copy
            b.master_init = None if self.param_dtype == wide else fp32[b.lo:b.hi].clone()
            b.param_buf = fp32 if self.param_dtype == wide else fp32.to(self.param_dtype)
            b.adopt(b.param_buf)
            b.grad_buf, b.grad_shard, b.launched = None, None, False
            stage.allocate_grads(self, b, device)
            for p in b.params:
                self._bucket_of[p] = b
                if hooked:
                    p.register_post_accumulate_grad_hook(self._on_grad)
        self._attach_grad_views()
        self._next = 0  # index of the next bucket to launch
        self.in_flight = InFlight()  # the launched collectives, in launch order
        self._clock = clock_for(device)  # the timeline clock (overlap checks): see last_hook_time
        self._last_hook = None  # its mark of the latest gradient arrival
        self._dirty = False  # a gradient arrived since the last finish_grad_sync

    @property
    def last_hook_time(self) -> float | None:
        """When the latest gradient arrived, in timeline seconds (`mini3d.timeline_clock`:
        perf_counter on CPU; on CUDA the GPU's time, once the step's read-back resolved it)."""
        return seconds_of(self._last_hook)

    def _attach_grad_views(self):
        if self._views:
            for b in self.buckets:
                for p in b.params:
                    if not self._grad_is_view(b, p):
                        p.grad = b.view_of(b.grad_buf, p)

    @staticmethod
    def _grad_is_view(b: FlatGroup, p: torch.Tensor) -> bool:
        """Whether p.grad is still its view of the bucket buffer (by address: building a view
        to compare costs microseconds per parameter per step)."""
        g, buf = p.grad, b.grad_buf
        return g is not None and g.data_ptr() == buf.data_ptr() + b.offset_of[id(p)] * buf.itemsize

    # ---- the hook and the launches -------------------------------------------------------
    def _on_grad(self, p: torch.Tensor):
        self._last_hook = self._clock.mark()
        b = self._bucket_of[p]
        every = self.strategy.reduces_every_micro_batch
        sync = self.require_sync or every
        if sync and b.launched:  # the next micro-batch's backward: finish the previous one's
            if not every:
                raise RuntimeError("a second synchronised backward before finish_grad_sync(): with "
                                   f"zero_stage={self.stage}, wrap all but the last micro-batch in "
                                   "no_sync()")
            self.finish_grad_sync()
        self._dirty = True
        if not self._views or sync:
            self._take_grad(b, p)  # (separate dtype: accumulate in the buffer under no_sync too)
        if not sync:
            return
        b.ready += 1
        if b.ready == len(b.params):
            self._launch_ready()

    def _take_grad(self, b: FlatGroup, p: torch.Tensor):
        """Make sure `p`'s gradient sits in the bucket buffer: with `_views` p.grad stays a view
        of it; otherwise the gradient is added into the stage's buffer (zero when a ZeRO-2
        bucket's is new; a bucket not yet complete may get a parameter's gradient twice, e.g. when
        it spans two interleaved model chunks) and p.grad dropped."""
        if self._views:
            if p.grad is not None and not self._grad_is_view(b, p):  # someone replaced it
                view = b.view_of(b.grad_buf, p)
                view.copy_(p.grad)
                p.grad = view
            return
        buf = self.strategy.grad_buffer(self, b)
        if p.grad is not None:
            view = b.view_of(buf, p)
            view.add_(p.grad)
            p.grad = None

    def _launch_ready(self):
        while self._next < len(self.buckets) and \
                self.buckets[self._next].ready == len(self.buckets[self._next].params):
            b = self.buckets[self._next]
            b.launched = True
            if b.prescale != 1.0:  # expert bucket: the edp average, divided by dp*cp (see above)
                self.strategy.grad_buffer(self, b).mul_(b.prescale)
            self.in_flight.add(*self.strategy.launch(self, b))
            self._next += 1

    def finish_grad_sync(self):
        """Launch any bucket not launched yet (e.g. all backward ran under no_sync, or some
        parameter got no gradient), wait for every collective, and reset for the next backward.
        Idempotent: a second call without a backward in between does nothing."""
        if not self._dirty:
            return
        for b in self.buckets[self._next:]:
            if not b.launched:
                for p in b.params:
                    self._take_grad(b, p)
                b.ready = len(b.params)
            self._launch_ready()  # one bucket at a time: its buffer exists only until reduced
        self.in_flight.drain(0)
        self._next = 0
        for b in self.buckets:
            b.ready, b.launched = 0, False
        self._dirty = False

    def zero_grad(self):
        for b in self.buckets:
            self.strategy.zero_grads(self, b)
            if not self._views:
                for p in b.params:
                    p.grad = None
        self._attach_grad_views()

    # ---- what the sharded optimizer and the ledger read ----------------------------------
    def shard_groups(self) -> list:
        """[(flat group, param shard view, callable giving the grad shard)] for the optimizer."""
        s = self.strategy
        return [(b, s.param_shard(b), lambda b=b: s.grad_shard(b)) for b in self.buckets]

    def after_step(self):
        """Every rank updated its shard: the stage brings the parameters back."""
        self.strategy.gather_params(self)

    def state_tensors(self) -> dict:
        """Persistent model-state tensors this wrapper holds, by ledger category."""
        return {"parameters": [b.param_buf for b in self.buckets],
                "gradients": [self.strategy.held_grads(b) for b in self.buckets]}

    # ---- full-shape views, for tests and checkpoints (collective) ------------------------
    def full_params(self) -> dict:
        names = param_names(self.module)
        return {names[p]: p.detach().clone() for b in self.buckets for p in b.params}

    def full_grads(self) -> dict:
        """{name: averaged gradient} (all-gathers the shards of a sharding stage)."""
        names, out = param_names(self.module), {}
        for b in self.buckets:
            full = self.strategy.full_grad(self, b)
            out.update({names[p]: v.clone() for p, v in b.views(full)})
        return out
