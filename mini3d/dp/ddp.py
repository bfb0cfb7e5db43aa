"""Data parallelism with bucketed gradient synchronisation that overlaps backward (ZeRO stages 0-2).

`DataParallel(module, dp_axis)` keeps whatever parameters `module` holds (a whole model, a pipeline
stage or a tensor-parallel shard) in flat buckets, filled in *reverse* registration order: backward
produces the last layers' gradients first, so the first bucket fills early. A
`register_post_accumulate_grad_hook` on every parameter counts arrivals; as soon as a bucket is
complete its collective is launched asynchronously on the dp axis while backward continues with the
earlier layers. Buckets are launched strictly in order so every rank issues the same collectives in
the same sequence. `finish_grad_sync()` waits for them all.

What the collective is depends on `zero_stage`:

* 0 (DDP): `all_reduce(avg)` of the bucket's gradient buffer. Each `p.grad` is a view into it, so the
  averaged values are already in place when the op completes (no copy back).
* 1 (optimizer states sharded): the full gradient buffer is kept (p.grad views, as above) but it is
  `reduce_scatter(avg)`-ed in place: only this rank's shard `lo:hi` receives the averaged gradient
  (the rest of the buffer is left undefined), which is all its optimizer shard needs. This is the
  ZeRO paper's P_os: reduce-scatter + all-gather of the updated parameters = the same 2 Psi wire
  volume as one all-reduce.
* 2 (gradients sharded too): the hook adds each fresh gradient into a transient bucket buffer and
  drops `p.grad`; the bucket is reduce-scattered in place (into its slice `lo:hi`), that slice is
  *added* into a persistent shard of size padded/n and the full buffer freed as soon as the
  reduce-scatter has completed: a bucket's buffer is allocated when its first gradient arrives, after
  the reductions of earlier buckets finished, so at most `GRAD_BUCKETS_IN_FLIGHT` full buffers are
  alive at any moment (see `buckets.transient_grad_bytes`). The collective still overlaps the
  backward compute of the layers that produce the next bucket's gradients.

Gradient dtype (`grad_dtype`, Plan.grad_dtype): with bf16 parameters the gradients are accumulated
and reduced in float32 by default, as Megatron-LM and FSDP do: each bf16 gradient is added into a
float32 bucket buffer and dropped, so micro-batch sums and the dp average are not rounded to 8 bits
each time, and the fp32 shard feeds the fp32 master without a copy; the price is 4 instead of 2
bytes per gradient element, in memory and on the wire (`grad_dtype=bf16`: halves, rounded).

`meter` (a `ledger.GradMeter`) follows every gradient buffer allocated and freed here: `peak` bytes.

Averaging: the collective divides the sum by dp. With the caller scaling each micro-batch loss by
1/micro_batches, the result equals the single-process gradient of the mean loss over the global batch.

Gradient accumulation: stages 0/1 hold full gradient buffers anyway, so inside `no_sync()` their
hooks do nothing and autograd accumulates straight into the bucket views; run every micro-batch but
the last under it: one collective per bucket per step (a second synchronised backward before
`finish_grad_sync` is an error). Stage 2 ignores `no_sync()`: every micro-batch's buckets are
reduce-scattered and added into the shard, so no full gradient outlives its bucket's reduction at
any micro-batch count, for micro_batches times the reduce-scatter traffic (why: zero.py,
"Micro-batches under ZeRO-2/3").
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn

from .. import comm
from .buckets import GRAD_BUCKETS_IN_FLIGHT, FlatGroup, param_names, split_into_buckets
from .ledger import GradMeter


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


class DataParallel(GradSyncWrapper):
    """Bucketed, overlapped gradient sync of `module`'s local parameters over `dp_axis`."""

    def __init__(self, module: nn.Module, dp_axis, bucket_mb: float = 1.0, zero_stage: int = 0,
                 param_dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None):
        super().__init__()
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"DataParallel handles zero_stage 0, 1 or 2, got {zero_stage}")
        self.module, self.axis, self.stage = module, dp_axis, zero_stage
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("module has no trainable parameters")
        self.param_dtype = param_dtype or params[0].dtype
        self.grad_dtype = grad_dtype or self.param_dtype
        self._separate = self.grad_dtype != self.param_dtype  # p.grad cannot view the buffers
        self.meter = GradMeter()
        device = params[0].device
        n, idx = (dp_axis.size, dp_axis.index) if zero_stage else (1, 0)
        runs = split_into_buckets(list(reversed(params)), int(bucket_mb * 2**20))
        # one replica whose p.grad are views of the buckets has nothing to reduce or move: no
        # hooks (their Python, per parameter and step, is a few percent of a small model's step)
        hooked = dp_axis.size > 1 or zero_stage == 2 or self._separate
        self.buckets = [FlatGroup(i, r, n, idx) for i, r in enumerate(runs)]
        self._bucket_of = {}
        for b in self.buckets:
            wide = torch.float64 if self.param_dtype == torch.float64 else torch.float32
            fp32 = b.flatten(wide, device)  # exact initial values, for the master copy
            b.master_init = None if self.param_dtype == wide else fp32[b.lo:b.hi].clone()
            b.param_buf = fp32 if self.param_dtype == wide else fp32.to(self.param_dtype)
            b.adopt(b.param_buf)
            b.grad_buf, b.grad_shard, b.launched = None, None, False
            if zero_stage < 2:
                b.grad_buf = torch.zeros(b.padded, dtype=self.grad_dtype, device=device)
                self.meter.hold(("buf", b.index), b.grad_buf)
            else:
                b.grad_shard = torch.zeros(b.shard_numel, dtype=self.grad_dtype, device=device)
                self.meter.hold(("shard", b.index), b.grad_shard)
            for p in b.params:
                self._bucket_of[p] = b
                if hooked:
                    p.register_post_accumulate_grad_hook(self._on_grad)
        self._attach_grad_views()
        self._next = 0  # index of the next bucket to launch
        self._works: list = []  # (work, finish callback) in launch order
        self.last_hook_time = None  # perf_counter() of the latest gradient arrival (overlap checks)
        self._dirty = False  # a gradient arrived since the last finish_grad_sync

    def _attach_grad_views(self):
        if self.stage < 2 and not self._separate:
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
        self.last_hook_time = time.perf_counter()
        b = self._bucket_of[p]
        sync = self.require_sync or self.stage == 2  # stage 2 reduces every micro-batch
        if sync and b.launched:  # the next micro-batch's backward: finish the previous one's
            if self.stage < 2:
                raise RuntimeError("a second synchronised backward before finish_grad_sync(): with "
                                   f"zero_stage={self.stage}, wrap all but the last micro-batch in "
                                   "no_sync()")
            self.finish_grad_sync()
        self._dirty = True
        if self._separate or sync:
            self._take_grad(b, p)  # (separate dtype: accumulate in the buffer under no_sync too)
        if not sync:
            return
        b.ready += 1
        if b.ready == len(b.params):
            self._launch_ready()

    def _take_grad(self, b: FlatGroup, p: torch.Tensor):
        """Make sure `p`'s gradient sits in the bucket buffer: stages 0/1 of one dtype keep p.grad
        as a view of it; otherwise the gradient is added into the buffer (zero when a stage-2
        bucket's is new; a bucket not yet complete may get a parameter's gradient twice, e.g. when
        it spans two interleaved model chunks) and p.grad dropped."""
        if self.stage < 2 and not self._separate:
            if p.grad is not None and not self._grad_is_view(b, p):  # someone replaced it
                view = b.view_of(b.grad_buf, p)
                view.copy_(p.grad)
                p.grad = view
            return
        self._ensure_buffer(b)
        if p.grad is not None:
            view = b.view_of(b.grad_buf, p)
            view.add_(p.grad)
            p.grad = None

    def _ensure_buffer(self, b: FlatGroup):
        """Stage 2: allocate the bucket's full buffer at its first gradient, once the earlier
        buckets' reductions have completed (at most GRAD_BUCKETS_IN_FLIGHT full buffers alive)."""
        if b.grad_buf is None:
            self._drain(GRAD_BUCKETS_IN_FLIGHT - 1)
            b.grad_buf = torch.zeros(b.padded, dtype=self.grad_dtype, device=b.param_buf.device)
            self.meter.hold(("buf", b.index), b.grad_buf)

    def _drain(self, limit: int):
        """Complete (wait for, then finish) the oldest launched collectives until at most `limit`
        are pending; a finished stage-2 bucket frees its full buffer here."""
        while len(self._works) > limit:
            work, finish = self._works.pop(0)
            work.wait()
            if finish is not None:
                finish()

    def _launch_ready(self):
        while self._next < len(self.buckets) and \
                self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: FlatGroup):
        b.launched = True
        if self.stage == 0:
            work = comm.all_reduce(b.grad_buf, self.axis, op="avg", async_op=True)
            self._works.append((work, None))
            return
        # in place: this rank's averaged shard lands in its own slice of the buffer (NCCL allows
        # recvbuff == sendbuff + rank * recvcount; gloo copies), so no output buffer is allocated
        work = comm.reduce_scatter(b.grad_buf[b.lo:b.hi], b.grad_buf, self.axis, op="avg",
                                   async_op=True)

        def finish(b=b):  # stage 2: add into the shard, free the full-size transient buffer
            b.grad_shard.add_(b.grad_buf[b.lo:b.hi])
            b.grad_buf = None
            self.meter.release(("buf", b.index))
        self._works.append((work, finish if self.stage == 2 else None))

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
        self._drain(0)
        self._next = 0
        for b in self.buckets:
            b.ready, b.launched = 0, False
        self._dirty = False

    def zero_grad(self):
        for b in self.buckets:
            if b.grad_buf is not None and self.stage < 2:
                b.grad_buf.zero_()
            if b.grad_shard is not None:
                b.grad_shard.zero_()
                b.grad_buf = None
                self.meter.release(("buf", b.index))
            for p in b.params:
                if self._separate or self.stage == 2:
                    p.grad = None
        self._attach_grad_views()

    # ---- what the sharded optimizer and the ledger read ----------------------------------
    def shard_groups(self) -> list:
        """[(flat group, param shard view, callable giving the grad shard)] for the optimizer."""
        if self.stage == 0:
            return [(b, b.param_buf, lambda b=b: b.grad_buf) for b in self.buckets]
        if self.stage == 1:
            return [(b, b.param_buf[b.lo:b.hi], lambda b=b: b.grad_buf[b.lo:b.hi])
                    for b in self.buckets]
        return [(b, b.param_buf[b.lo:b.hi], lambda b=b: b.grad_shard) for b in self.buckets]

    def after_step(self):
        """Stages 1/2: every rank updated its shard; all-gather the buckets' parameters."""
        if self.stage == 0:
            return
        for w in [comm.all_gather(b.param_buf, b.param_buf[b.lo:b.hi].clone(), self.axis,
                                  async_op=True) for b in self.buckets]:
            w.wait()

    def state_tensors(self) -> dict:
        """Persistent model-state tensors this wrapper holds, by ledger category."""
        grads = [b.grad_buf for b in self.buckets if b.grad_buf is not None and self.stage < 2]
        grads += [b.grad_shard for b in self.buckets if b.grad_shard is not None]
        return {"parameters": [b.param_buf for b in self.buckets], "gradients": grads}

    # ---- full-shape views, for tests and checkpoints (collective) ------------------------
    def full_params(self) -> dict:
        names = param_names(self.module)
        return {names[p]: p.detach().clone() for b in self.buckets for p in b.params}

    def full_grads(self) -> dict:
        """{name: averaged gradient} (all-gathers the shards for stages 1/2)."""
        names, out = param_names(self.module), {}
        for b in self.buckets:
            if self.stage == 0:
                full = b.grad_buf.clone()
            else:
                shard = b.grad_buf[b.lo:b.hi] if self.stage == 1 else b.grad_shard
                full = torch.empty(b.padded, dtype=shard.dtype, device=shard.device)
                comm.all_gather(full, shard.clone(), self.axis)
            out.update({names[p]: v.clone() for p, v in b.views(full)})
        return out
