"""Traced communication: every collective and point-to-point op mini3d issues goes through here.

Each call records an `Event` (rank, axis, op, per-axis sequence number, shape, dtype, bytes, start and
end time: the host's, on CUDA the GPU's too, see `mini3d.comm_log`) in a bounded per-process ring
buffer (`CommLog`), and adds to per-axis byte counters. The log feeds three things: the hang
watchdog and `explain-hang` (which op, on which group, is pending), the measured communication
volume per axis, and measured timelines.

Two byte counts are kept per event:

* `bytes`: the payload, i.e. the size of the (full) tensor the op is about;
* `wire_bytes`: what one rank sends under the bandwidth-optimal ring algorithm, for a group of n:
  all-reduce 2 (n-1)/n * bytes (a reduce-scatter then an all-gather), all-gather and reduce-scatter
  (n-1)/n * bytes of the full tensor, broadcast bytes (pipelined), send = bytes, recv = 0;
  all-to-all (`all_to_all`, expert parallelism's token exchange): the rows this rank sends to the
  other members (its own block stays home), whatever the algorithm.

Ops on a one-member group return at once and record nothing: there is nothing to communicate.

Completion: every op's Work is followed until it has *completed*, not merely until `wait()`
returned (`mini3d.comm_log.TracedWork`; why: the comm_log module docstring).

Every op first checks its tensors (`check_tensors`): all on the axis' device (`Axis.device`, the
rank's device) and of one dtype (the one the caller expects, when it says). NCCL rejects a CPU tensor
and gloo a meta one, but only deep inside the library and only when the op runs on that backend;
the check fails on any backend, before anything is issued, with a message naming the op, the axis
and the devices, so a CPU run under MINI3D_STRICT_DEVICE=1 catches what a GPU run would.
The wrappers are thin on purpose; the cost is one small object and two clock reads per op (on a GPU two CUDA events more).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mini3d.comm_log import DONE, CommLog, TracedWork, new_batch_id, wait_settled

# torch >= 2.10 renamed the *_into_tensor / *_tensor collectives; use whichever this torch has.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "avg": None}


SKIP = object()  # returned by a fault hook: do not issue this op at all (see diagnose/faults.py)


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
               "all_to_all")  # the rest is p2p


def ring_steps(op: str, n: int) -> int:
    """Sequential messages one rank sends in op's ring algorithm over n members, each paying one
    link latency: an all-reduce is a reduce-scatter (n-1 steps) then an all-gather (n-1 more), so
    2(n-1); an all-gather or reduce-scatter alone n-1; a send 1 (Thakur, Rabenseifner and Gropp
    2005, the alpha term of the ring algorithms)."""
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "send": 1}[op]


def ring_wire_bytes(op: str, n: int, nbytes: int) -> int:
    """Bytes one rank sends in op's ring algorithm over n members, for a full tensor of `nbytes`:
    each step moves nbytes/n, so 2(n-1)/n * nbytes for an all-reduce, (n-1)/n * nbytes for an
    all-gather or reduce-scatter, nbytes for a send (the `wire_bytes` of the event log). Integer
    sizes give the log's integer bytes; float sizes (the cost model's) are not rounded."""
    if op == "send":
        return nbytes
    if n <= 1:
        return 0
    steps = ring_steps(op, n)
    return steps * nbytes // n if isinstance(nbytes, int) else steps * nbytes / n


class DeviceMismatch(RuntimeError):
    """A collective / p2p op got a tensor on the wrong device or of the wrong dtype."""


def check_tensors(axis, op: str, *tensors: torch.Tensor, dtype: torch.dtype | None = None):
    """Raise DeviceMismatch unless every tensor is on `axis.device` (when the axis knows it) and
    all share one dtype (`dtype`, when given)."""
    want = getattr(axis, "device", None)
    for t in tensors:
        if want is not None and t.device != want:
            raise DeviceMismatch(
                f"{op} on the {axis.name} axis {list(axis.ranks)}: a tensor of shape "
                f"{tuple(t.shape)} is on {t.device}, but this rank's tensors live on {want} "
                f"(create it with device=..., or .to(device) first; NCCL needs CUDA tensors)")
    dtypes = {t.dtype for t in tensors} | ({dtype} if dtype is not None else set())
    if len(dtypes) > 1:
        raise DeviceMismatch(f"{op} on the {axis.name} axis {list(axis.ranks)}: tensors of dtypes "
                             f"{sorted(str(d) for d in dtypes)} in one op"
                             + (f" (expected {dtype})" if dtype is not None else ""))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _run(axis, op, tensor, nbytes, wire, fn, async_op, peer=None, seq_key=None, after=None,
         splits=None):
    """Record, issue `fn(tensor)` (always asynchronously: it returns a Work), and wait for it
    unless the caller asked for `async_op` (then the caller waits through TracedWork). `splits`:
    an all-to-all's (input, output) split sizes, kept on the event (for explain-hang) and issued
    as the event has them, `fn(tensor, ev.splits)` (a fault may change them: a2a-split)."""
    log = axis.log
    eid, ev = log.begin(axis, op, tensor, nbytes, wire, peer, seq_key, splits=splits)
    if log.fault is not None:
        tensor = log.fault(ev, tensor)
        if tensor is SKIP:
            log.retract(eid, ev, seq_key)
            return DONE if async_op else None
        ev.shape = tuple(tensor.shape)  # a fault may have changed it (an all-to-all's splits too)
    work = fn(tensor) if splits is None else fn(tensor, ev.splits)
    log.issued([ev], [work], axis.group)  # CUDA: the op's GPU completion (timeline_clock)
    blocking = tensor.device.type != "cuda"  # gloo's wait() returns once the op is done
    if async_op:
        return TracedWork(work, log, eid, ev, after, blocking)
    wait_settled(log, eid, ev, work, after, blocking)
    return None


def _reduce_op(op: str, name: str, allowed=tuple(_REDUCE)):
    if op not in allowed:
        raise ValueError(f"{name}: op={op!r} is not supported (choose {', '.join(allowed)})")


def all_reduce(tensor: torch.Tensor, axis, op: str = "sum", async_op: bool = False,
               dtype: torch.dtype | None = None):
    """In-place all-reduce over the axis' group. `op="avg"` divides the sum by the group size."""
    _reduce_op(op, "all_reduce")
    check_tensors(axis, "all_reduce", tensor, dtype=dtype)
    n = axis.size
    if n == 1:
        return DONE if async_op else None
    b = _nbytes(tensor)
    after = (lambda: tensor.div_(n)) if op == "avg" else None
    rop = _REDUCE["sum"] if op == "avg" else _REDUCE[op]
    return _run(axis, "all_reduce", tensor, b, ring_wire_bytes("all_reduce", n, b),
                lambda t: dist.all_reduce(t, op=rop, group=axis.group, async_op=True),
                async_op, after=after)


def all_gather(output: torch.Tensor, input: torch.Tensor, axis, async_op: bool = False,
               dtype: torch.dtype | None = None):
    """Gather equal shards along dim 0: output = cat([input of each member, by axis index])."""
    check_tensors(axis, "all_gather", output, input, dtype=dtype)
    n = axis.size
    if n == 1:
        output.copy_(input)
        return DONE if async_op else None
    b = _nbytes(output)
    return _run(axis, "all_gather", output, b, ring_wire_bytes("all_gather", n, b),
                lambda t: _all_gather(t, input, group=axis.group, async_op=True),
                async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, axis, op: str = "sum",
                   async_op: bool = False, dtype: torch.dtype | None = None):
    """Sum (`op="sum"`) or average (`"avg"`) `input` over the group and keep this member's dim-0
    shard in `output`; any other op is an error (it would otherwise be summed silently)."""
    _reduce_op(op, "reduce_scatter", ("sum", "avg"))
    check_tensors(axis, "reduce_scatter", output, input, dtype=dtype)
    n = axis.size
    if n == 1:
        output.copy_(input)
        return DONE if async_op else None
    b = _nbytes(input)
    after = (lambda: output.div_(n)) if op == "avg" else None
    return _run(axis, "reduce_scatter", input, b, ring_wire_bytes("reduce_scatter", n, b),
                lambda t: _reduce_scatter(output, t, op=_REDUCE["sum"], group=axis.group,
                                          async_op=True),
                async_op, after=after)


def _splits(name: str, splits, rows: int, n: int, axis) -> list[int]:
    """Split sizes along dim 0, one per member (equal when None), checked against `rows`."""
    if splits is None:
        if rows % n:
            raise ValueError(f"all_to_all on the {axis.name} axis {list(axis.ranks)}: {rows} rows "
                             f"do not split equally over {n} members (give {name})")
        return [rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n or sum(splits) != rows or min(splits) < 0:
        raise ValueError(f"all_to_all on the {axis.name} axis {list(axis.ranks)}: {name}={splits} "
                         f"must be {n} sizes >= 0 summing to the tensor's {rows} rows")
    return splits


def all_to_all(output: torch.Tensor, input: torch.Tensor, axis, output_splits=None,
               input_splits=None, async_op: bool = False, dtype: torch.dtype | None = None):
    """Member i sends rows input_splits[j] (its j-th block of dim 0, by axis index) to member j
    and receives member j's block for it into rows output_splits[j] of `output` (equal blocks
    when the splits are None). The sizes must agree across the group (what i sends j is what j
    expects from i); mini3d's MoE dispatch exchanges them first. The event's `bytes` is the input
    tensor, `wire_bytes` the rows that leave this rank; the event keeps the splits."""
    check_tensors(axis, "all_to_all", output, input, dtype=dtype)
    n = axis.size
    ins = _splits("input_splits", input_splits, input.shape[0] if input.dim() else 0, n, axis)
    outs = _splits("output_splits", output_splits, output.shape[0] if output.dim() else 0, n, axis)
    if n == 1:
        output.copy_(input)
        return DONE if async_op else None
    row = input.element_size() * (math.prod(input.shape[1:]) if input.dim() else 1)
    b, wire = _nbytes(input), (sum(ins) - ins[axis.index]) * row
    return _run(axis, "all_to_all", input, b, wire,
                lambda t, s: dist.all_to_all_single(output, t, list(s[1]), list(s[0]),
                                                    group=axis.group, async_op=True),
                async_op, splits=(tuple(ins), tuple(outs)))


def broadcast(tensor: torch.Tensor, axis, src_index: int = 0, async_op: bool = False):
    """Broadcast from the member at `src_index` along the axis."""
    check_tensors(axis, "broadcast", tensor)
    if axis.size == 1:
        return DONE if async_op else None
    b = _nbytes(tensor)
    return _run(axis, "broadcast", tensor, b, b if axis.index == src_index else 0,
                lambda t: dist.broadcast(t, axis.ranks[src_index], group=axis.group,
                                         async_op=True), async_op)


def send(tensor: torch.Tensor, axis, peer: int, async_op: bool = False,
         dtype: torch.dtype | None = None):
    """Point-to-point send to world rank `peer` (a member of the axis' group)."""
    check_tensors(axis, "send", tensor, dtype=dtype)
    b = _nbytes(tensor)
    return _run(axis, "send", tensor, b, b, lambda t: dist.isend(t, peer), async_op, peer=peer,
                seq_key=f"p2p->{peer}")


def recv(tensor: torch.Tensor, axis, peer: int, async_op: bool = False,
         dtype: torch.dtype | None = None):
    """Point-to-point receive into `tensor` from world rank `peer`."""
    check_tensors(axis, "recv", tensor, dtype=dtype)
    b = _nbytes(tensor)
    return _run(axis, "recv", tensor, b, 0, lambda t: dist.irecv(t, peer), async_op, peer=peer,
                seq_key=f"p2p<-{peer}")


class TracedBatch:
    """The work of one `batch_p2p`: `wait()` waits for the whole batch, then settles every op's
    event (the host blocks in this wait even under MINI3D_DEFERRED_WAIT)."""

    def __init__(self, works, log: CommLog, events: list, blocking: bool):
        self.works, self.log, self.events, self.blocking = list(works), log, events, blocking
        self.done = False

    def wait(self):
        if not self.done:
            self.done = True
            for w in self.works:
                w.wait()
            for eid, ev in self.events:
                self.log.settle(eid, ev, self, blocked=self.blocking)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def batch_p2p(ops: list[tuple], axis, async_op: bool = False, dtype: torch.dtype | None = None):
    """Sends and receives issued as one group (`dist.batch_isend_irecv`): `ops` is a list of
    ("send" | "recv", tensor, world rank of the peer). On NCCL they progress together (one
    ncclGroup): two ranks sending to each other, or a ring, cannot block on each other's send; gloo
    issues them one by one (its isend never blocks). Each op is logged as its own event with one
    `batch` id, which the program checker matches as a unit. Returns the batch's work (`async_op`),
    else waits for it."""
    check_tensors(axis, "batch_p2p", *(t for _, t, _ in ops), dtype=dtype)
    log, batch = axis.log, new_batch_id()
    p2p, events = [], []
    for kind, tensor, peer in ops:
        seq_key = {"send": f"p2p->{peer}", "recv": f"p2p<-{peer}"}[kind]  # the keys send/recv use
        b = _nbytes(tensor)
        eid, ev = log.begin(axis, kind, tensor, b, b if kind == "send" else 0, peer, seq_key, batch)
        if log.fault is not None:
            tensor = log.fault(ev, tensor)
            if tensor is SKIP:
                log.retract(eid, ev, seq_key)
                continue
        p2p.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer))
        events.append((eid, ev))
    if not p2p:
        return DONE if async_op else None
    works = dist.batch_isend_irecv(p2p)
    log.issued([ev for _, ev in events], works, axis.group)
    work = TracedBatch(works, log, events, blocking=p2p[0].tensor.device.type != "cuda")
    if async_op:
        return work
    work.wait()
    return None


def barrier(axis):
    if axis.size == 1:
        return
    t = torch.zeros(1, device=axis.device or "cpu")  # only recorded: a barrier carries no data
    _run(axis, "barrier", t, 0, 0, lambda _: dist.barrier(group=axis.group, async_op=True), False)
