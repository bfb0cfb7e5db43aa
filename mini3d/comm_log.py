"""The collective event log: one `Event` per op mini3d issues (rank, axis, op, per-axis sequence
number, shape, dtype, payload and ring wire bytes, start and end), kept in a bounded per-process
`CommLog` with per-axis counters. `mini3d.comm`'s wrappers write it; the hang watchdog, `explain-hang`,
the measured communication volumes and the measured timelines read it.

The p2p record (`P2P_RECORD`): under MINI3D_CHECK_P2P=1 a `mini3d.launch.launcher` worker turns it on
(`start_p2p_record`) and every CommLog of the process (a test may build several topologies in
one launch) appends each point-to-point op it issues, and each wait, in program order; the
launcher checks the ranks' records against each other (`mini3d.launch.p2p_record`). One record per
process, not per log, on purpose: it is the process' program the rules judge. Off by default, so a
long job's memory does not grow.

Completion: every op is issued asynchronously and its `Work` is followed until it has *completed*,
not merely until `wait()` returned. On gloo `wait()` blocks until the data is there; on NCCL it only
makes the compute stream wait and returns at once, and the host blocks later (in `.item()`,
`float(loss)`...), outside any mini3d call. An op whose wait returned before its Work completed stays
in `CommLog.pending` (with its Work in `CommLog.works`) until `CommLog.reap()` (the hang watchdog
calls it every poll, `begin` too) sees it completed, so the watchdog times a hang the same way on
both backends. MINI3D_DEFERRED_WAIT=1 is a test mode that makes gloo behave like NCCL here: mini3d's
waits return before the op completes and the host blocks right afterwards, outside mini3d's wait.

Clocks: `Event.start` / `end` are the host's (time.perf_counter at issue and at completion as above),
on every device: the hang watchdog reads them while the op is pending. On CUDA tensors the event also
gets the GPU's (`mini3d.timeline_clock`): `gpu_start`, a timing event on the compute stream before
the issue (NCCL's stream waits for that stream's earlier work), and `gpu_end`, on NCCL a mark on the
clock's side stream made to wait for the op's Work at issue (the op's completion on the GPU, nothing
held), both resolved to seconds at the step's read-back. `as_dict` (the snapshot the overlap
analysis, the course figures and the benchmarks read) gives those as `start` / `end` once resolved,
the host's then under `host_start` / `host_end`; on CPU it is the host's fields alone, as ever.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mini3d.timeline_clock import clock_for, seconds_of

DEFERRED_WAIT_ENV = "MINI3D_DEFERRED_WAIT"  # test mode: waits return before completion (NCCL-like)
CHECK_P2P_ENV = "MINI3D_CHECK_P2P"  # "1": launch workers record their p2p program (checked at exit)
_BATCH_IDS = itertools.count()  # batch ids, unique in the process (see comm.batch_p2p)
_LOG_IDS = itertools.count()  # one serial per CommLog: (serial, event id) names an op in the process


class _P2PRecord:
    entries: list | None = None  # ("issue" | "wait", op key, (kind, peer, label, batch, shape, dtype))


P2P_RECORD = _P2PRecord()


def start_p2p_record():
    """Record this process' p2p program from now on (see the module docstring)."""
    P2P_RECORD.entries = []


def new_batch_id() -> int:
    return next(_BATCH_IDS)


def _p2p_entry(what: str, eid: int, log, ev) -> None:
    if P2P_RECORD.entries is not None and ev.peer is not None:
        label = " ".join(str(x) for x in (ev.op, ev.context.get("action", ""), f"#{ev.seq}") if x)
        P2P_RECORD.entries.append((what, (log.serial, eid), (ev.op, ev.peer, label, ev.batch, ev.shape,
                                                          ev.dtype)))


@dataclass(slots=True)
class Event:
    rank: int  # world rank that issued the op
    axis: str  # tp, pp, dp, mp, embedding or world
    op: str  # all_reduce, all_gather, reduce_scatter, broadcast, send, recv, barrier, all_to_all
    seq: int  # per (axis, op-kind) sequence number on this rank: equal across a group's members
    group: tuple  # world ranks of the group
    shape: tuple
    dtype: str
    bytes: int  # payload bytes (full tensor)
    wire_bytes: int  # ring-algorithm bytes this rank sends
    start: float  # time.perf_counter() at issue (the host's, on every device: the watchdog's)
    end: float | None = None  # the host's completion (None while pending)
    peer: int | None = None  # p2p partner (world rank)
    context: dict = field(default_factory=dict)  # e.g. {"step": 3, "action": "F1", "mb": 2}
    batch: int | None = None  # p2p ops issued as one batch_isend_irecv group share it
    splits: tuple | None = None  # all_to_all: (input split sizes, output split sizes), by member
    gpu_start: object = None  # CUDA: timeline_clock mark before the issue (None on CPU)
    gpu_end: object = None  # CUDA + NCCL: mark of the op's completion on the GPU

    def as_dict(self) -> dict:
        """The fields; `start` / `end` the GPU's once resolved, the host's then as `host_start` /
        `host_end` (module docstring); on CPU, and until then, the host's."""
        d = {k: getattr(self, k) for k in self.__slots__ if k not in ("gpu_start", "gpu_end")}
        if self.gpu_start is not None and self.gpu_end is not None:
            s, e = seconds_of(self.gpu_start), seconds_of(self.gpu_end)
            if s is not None and e is not None:
                d.update(host_start=self.start, host_end=self.end, start=s, end=e)
        return d


class CommLog:
    """Per-process, bounded record of communication, with per-axis counters."""

    def __init__(self, rank: int = 0, capacity: int = 4096):
        self.rank = rank
        self.serial = next(_LOG_IDS)
        self.events: collections.deque[Event] = collections.deque(maxlen=capacity)
        self.bytes_by_axis: collections.Counter = collections.Counter()
        self.wire_bytes_by_axis: collections.Counter = collections.Counter()
        self.count_by_axis_op: collections.Counter = collections.Counter()
        self._seq: collections.Counter = collections.Counter()
        self.pending: dict[int, Event] = {}
        self.works: dict = {}  # event id -> Work, for pending ops whose wait returned (see reap)
        self.deferred_wait = os.environ.get(DEFERRED_WAIT_ENV, "") == "1"
        self._ids = itertools.count()
        self.context: dict = {}  # set by the trainer / pipeline runtime (step, action, micro-batch)
        self.lock = threading.Lock()  # the watchdog thread reads `pending`
        self.fault = None  # optional callable(event, tensor) -> tensor, or SKIP to drop the op
        self.on_issue = None  # optional callable(event, retracted=False): each op as it is begun
        # and each retracted (the watchdog's black box, mini3d.diagnose.blackbox)

    def reset_counters(self):
        self.bytes_by_axis.clear()
        self.wire_bytes_by_axis.clear()
        self.count_by_axis_op.clear()

    def begin(self, axis, op: str, tensor: torch.Tensor, nbytes: int, wire: int,
              peer: int | None = None, seq_key: str | None = None,
              batch: int | None = None, splits: tuple | None = None) -> tuple[int, Event]:
        key = (axis.name, seq_key or op)
        if self.works:
            self.reap()
        clock = clock_for(tensor.device)
        gpu_start = clock.mark() if clock.gpu else None  # before the issue (module docstring)
        with self.lock:  # the watchdog thread reads the counters (seq_counts) while we issue
            self._seq[key] += 1
            ev = Event(self.rank, axis.name, op, self._seq[key], axis.ranks, tuple(tensor.shape),
                       str(tensor.dtype).replace("torch.", ""), nbytes, wire, time.perf_counter(),
                       peer=peer, context=dict(self.context), batch=batch, splits=splits,
                       gpu_start=gpu_start)
            self.bytes_by_axis[axis.name] += nbytes
            self.wire_bytes_by_axis[axis.name] += wire
            self.count_by_axis_op[(axis.name, op)] += 1
            eid = next(self._ids)
            self.pending[eid] = ev
            self.events.append(ev)
        _p2p_entry("issue", eid, self, ev)
        if self.on_issue is not None:
            self.on_issue(ev)
        return eid, ev

    def issued(self, events, works, group):
        """The ops of `events` were issued as `works`: on CUDA, mark their completion on the GPU
        (`timeline_clock.CudaClock.mark_done`; NCCL only, whose wait does not block the host)."""
        if events and events[0].gpu_start is not None:
            done = events[0].gpu_start.clock.mark_done(works, dist.get_backend(group) == "nccl")
            for ev in events:
                ev.gpu_end = done

    def end(self, eid: int, ev: Event):
        ev.end = time.perf_counter()
        with self.lock:
            if self.pending.pop(eid, None) is not None:
                _p2p_entry("wait", eid, self, ev)
            self.works.pop(eid, None)

    def settle(self, eid: int, ev: Event, work, blocked: bool = False):
        """The host's wait for `work` returned: end the event if the op has completed (`blocked`:
        the wait itself blocked until it had, as gloo's does; some gloo Works never report
        is_completed()), else keep following its Work (`reap`)."""
        if blocked or work is None or work.is_completed():
            self.end(eid, ev)
        else:
            with self.lock:
                self.works[eid] = work

    def reap(self):
        """End every pending op whose Work has completed since its wait returned (thread-safe)."""
        with self.lock:
            done = [eid for eid, w in self.works.items() if w.is_completed()]
            now = time.perf_counter()
            for eid in done:
                self.works.pop(eid)
                ev = self.pending.pop(eid, None)
                if ev is not None:
                    ev.end = now
                    _p2p_entry("wait", eid, self, ev)

    def retract(self, eid: int, ev: Event, seq_key: str | None = None):
        """Undo `begin` for an op that will not be issued (fault injection: a skipped collective)."""
        with self.lock:
            self._seq[(ev.axis, seq_key or ev.op)] -= 1
            self.bytes_by_axis[ev.axis] -= ev.bytes
            self.wire_bytes_by_axis[ev.axis] -= ev.wire_bytes
            self.count_by_axis_op[(ev.axis, ev.op)] -= 1
            self.pending.pop(eid, None)
            if self.events and self.events[-1] is ev:
                self.events.pop()
            if P2P_RECORD.entries and P2P_RECORD.entries[-1][1] == (self.serial, eid):
                P2P_RECORD.entries.pop()
        if self.on_issue is not None:
            self.on_issue(ev, retracted=True)

    def seq_counts(self) -> dict[str, int]:
        """Ops issued so far per "axis/op-kind" key (p2p keys name the peer, e.g. "pp/p2p->3").
        Safe from another thread (the watchdog): read under the lock `begin` writes under."""
        with self.lock:
            return {f"{a}/{k}": n for (a, k), n in self._seq.items()}

    def count(self, axis: str, op: str) -> int:
        return self.count_by_axis_op[(axis, op)]

    def snapshot(self) -> list[dict]:
        with self.lock:
            return [e.as_dict() for e in self.events]


__all__ = ["Event", "CommLog", "DEFERRED_WAIT_ENV", "CHECK_P2P_ENV", "P2P_RECORD", "start_p2p_record",
           "new_batch_id"]


def wait_settled(log: CommLog, eid: int, ev: Event, work, after=None, blocking: bool = True):
    """Wait for an issued op: `work.wait()` (blocks until done on gloo, `blocking`; on NCCL only
    orders the streams), then hand the Work to the log, which ends the event only once the op has
    completed (`settle`). Under MINI3D_DEFERRED_WAIT=1 the wait itself returns at once and the host
    blocks after it, as NCCL's host does later at its next synchronisation."""
    if not log.deferred_wait:
        work.wait()
    log.settle(eid, ev, work, blocked=blocking and not log.deferred_wait)
    if log.deferred_wait:
        work.wait()  # the "host" blocks here, after mini3d's wait returned (test mode)
        log.settle(eid, ev, work, blocked=blocking)
    if after is not None:
        after()


class TracedWork:
    """Wraps an async `Work`; `wait()` waits as `wait_settled` says (the event ends on completion)."""

    def __init__(self, work, log: CommLog, eid: int, ev: Event, after=None, blocking=True):
        self.work, self.log, self.eid, self.ev, self.after = work, log, eid, ev, after
        self.blocking, self.done = blocking, False

    def wait(self):
        if not self.done:
            self.done = True
            wait_settled(self.log, self.eid, self.ev, self.work, self.after, self.blocking)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _Done:
    def wait(self):
        pass

    def is_completed(self):
        return True


DONE = _Done()
