"""Flat buffers: a run of parameters laid end to end in one tensor, padded so it splits into shards.

Every data-parallel mode in mini3d works on `FlatGroup`s. A group owns a list of parameters, their
offsets in one flat buffer, and this rank's shard of that buffer:

    buffer   [ p0 ........ | p1 .... | p2 ...... | pad ]   numel = sum of the params
    shards   [ rank 0     ][ rank 1     ][ rank 2     ]    padded = ceil(numel / n) * n

Padding (documented once, here): a group whose numel is not a multiple of the shard count n gets
`padded - numel < n` zero elements at its end, so that every rank's shard has the same length
`padded / n` (collectives want equal pieces). Padding elements have zero gradient and stay zero
under AdamW (weight decay of 0 is 0, the update of a zero moment is 0), and they are counted by the
memory ledger: a ZeRO model holds at most `n_groups * (n - 1)` padding elements per buffer.
With n = 1 (plain data parallelism) there is no padding.
"""

from __future__ import annotations

import torch


class FlatGroup:
    """Parameters sharing one flat buffer; `lo:hi` is this rank's shard of it."""

    def __init__(self, index: int, params: list, n_shards: int, shard_index: int):
        self.index = index
        self.params = list(params)
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.padded = -(-off // n_shards) * n_shards
        self.shard_numel = self.padded // n_shards
        self.lo = shard_index * self.shard_numel
        self.hi = self.lo + self.shard_numel
        self.offset_of = {id(p): o for p, o in zip(self.params, self.offsets)}
        self.ready = 0  # parameters whose gradient arrived in the current backward

    def views(self, flat: torch.Tensor):
        """(param, view of `flat` shaped like param) for each parameter."""
        for p, off in zip(self.params, self.offsets):
            yield p, flat[off:off + p.numel()].view(p.shape)

    def view_of(self, flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        off = self.offset_of[id(p)]
        return flat[off:off + p.numel()].view(p.shape)

    def flatten(self, dtype, device) -> torch.Tensor:
        """A new padded flat tensor holding the parameters' current values."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for p, v in self.views(flat):
            v.copy_(p.detach())
        return flat

    def adopt(self, flat: torch.Tensor):
        """Make each parameter's data a view of `flat` (same storage: no copy, no extra bytes)."""
        for p, v in self.views(flat):
            p.data = v

    def __repr__(self):
        return (f"FlatGroup({self.index}, params={len(self.params)}, numel={self.numel}, "
                f"padded={self.padded}, shard={self.lo}:{self.hi})")


def split_into_buckets(params: list, bucket_bytes: int) -> list[list]:
    """Consecutive runs of `params`, each of at most `bucket_bytes`: a bucket closes before the
    parameter that would overflow it. A parameter is never split across buckets, so one tensor
    larger than `bucket_bytes` makes a bucket of its own (`largest_bucket_numel`)."""
    buckets, cur, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def runs_by_axis(params: list, dp_axis, expert_axis) -> list[tuple]:
    """[(axis, prescale, consecutive parameters)]: maximal runs of dense parameters (on `dp_axis`,
    prescale 1) and of expert slices (`ep_expert`, on `expert_axis`), in the given order (reverse
    registration: the runs follow the backward, so expert buckets launch as their layer's
    gradients arrive). An expert run's gradient is multiplied by `prescale` = |edp| / |dp x cp|
    = 1/ep before its edp average (mini3d.dp.ddp, "Expert parallelism": a rank's expert gradient
    already sums its whole ep group's tokens); the one formula, for ZeRO-0-2 and ZeRO-3."""
    out = []
    for p in params:
        axis = expert_axis if expert_axis is not None and getattr(p, "ep_expert", False) else dp_axis
        if out and out[-1][0] is axis:
            out[-1][2].append(p)
        else:
            out.append((axis, 1.0 if axis is dp_axis else axis.size / dp_axis.size, [p]))
    return out


def largest_bucket_numel(bucket_numel: int, largest_param_numel: int) -> int:
    """Elements of the largest bucket `split_into_buckets` makes from buckets of `bucket_numel`
    elements and parameters of at most `largest_param_numel` (before shard padding)."""
    return max(bucket_numel, largest_param_numel)


# ZeRO-2/3: full-size gradient buffers alive at once. A bucket's buffer is allocated at its first
# gradient after waiting until fewer than this many earlier reductions are pending, so with 2 the
# reduce-scatter of bucket k runs during the whole backward that fills bucket k + 1 and is waited
# only when bucket k + 2 needs memory (with 1, bucket k + 1's first gradient waited for it: the
# reduction overlapped only the hook's own work). A third buffer would help only where one
# reduction outlasts a bucket's backward, and costs one more bucket of memory.
GRAD_BUCKETS_IN_FLIGHT = 2


class InFlight:
    """Asynchronous collectives in issue order, each with what to do once it has completed
    (`finish`: e.g. add a reduced bucket into its shard and free the bucket's full buffer).
    Every rank issues and completes them in the same order."""

    def __init__(self):
        self.works: list = []  # (work, finish or None), oldest first

    def add(self, work, finish=None):
        self.works.append((work, finish))

    def drain(self, limit: int = 0):
        """Wait for (then finish) the oldest until at most `limit` are pending."""
        while len(self.works) > limit:
            work, finish = self.works.pop(0)
            work.wait()
            if finish is not None:
                finish()

    def __len__(self):
        return len(self.works)


def transient_grad_bytes(bucket_bytes: float, dp: int, zero: int) -> float:
    """Gradient bytes one rank holds during backward beyond its persistent gradients, buckets of at
    most `bucket_bytes`: none for ZeRO-0/1 (they reduce in place), the GRAD_BUCKETS_IN_FLIGHT
    buckets' full buffers for ZeRO-2/3 (each freed once reduce-scattered into the shard). A bound
    within one bucket: the measured `peak_grad_bytes` is the largest sum of that many consecutive
    buckets (a small one, e.g. a LayerNorm's, lowers it), a layout the estimator does not see."""
    return GRAD_BUCKETS_IN_FLIGHT * bucket_bytes if zero >= 2 and dp > 1 else 0.0


def param_names(module) -> dict:
    """{parameter: its name in `module`} (for gathering full-shape state back by name)."""
    return {p: n for n, p in module.named_parameters()}
