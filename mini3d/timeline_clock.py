"""The clock of mini3d's measured timelines: the pipeline runtime's actions (`StepResult.timeline`),
the trainer's forwards and backwards at pp = 1 (`records.timed`), the collectives' device-side
start and end (`comm_log.Event.gpu_start` / `gpu_end`) and DDP's last gradient hook. One owner:
`clock_for(device)`; everything that stamps a timeline asks it.

CPU (any device but CUDA): `HostClock`, `time.perf_counter()` seconds, as ever: what the host ran is
what the device ran, and one clock serves all local processes.

CUDA: the host only queues the work, so a host stamp around an action is its launch time, not its
GPU time. `CudaClock.mark()` records a CUDA timing event (`_event`) on the
current stream instead, and nothing waits inside the step. The step's read-back
(`mini3d.run.train.read_back`, or `PipelineRuntime.step` when it reads the loss itself) calls
`resolve()` once a step: one device synchronize (`_synchronize`; the read-back has
just waited for the step's work, so it waits for little more), then every timeline span recorded
since becomes float seconds in place. A collective's end (`mark_done`): on NCCL, a mark on the
clock's own side stream made to wait for the op's Work at issue (`work.wait()` orders the
*current* stream, here the side stream), so it is the op's completion on the GPU and the compute
stream is not held; on another backend with CUDA tensors the op keeps its host times
(`comm_log.Event.as_dict`).

The scale: host seconds, so timelines of different ranks line up as perf_counter's do. The first
mark after a resolve records an anchor event together with a host perf_counter stamp; a mark's
seconds are its anchor's stamp + anchor.elapsed_time(mark). The approximation: the anchor's GPU
time is taken to be its host stamp. The GPU reaches it later by the launch latency (microseconds)
and by whatever work was still queued ahead of it: little, since the last read-back emptied the
queue, but work queued after it (a validation pass) before the first mark shifts all of the
step's times later by as much, consistently on the rank, so ranks compared can be off by it. The
hang watchdog keeps the host's clock on purpose (`comm_log.Event.start` / `end`): it must see a
wait grow while the GPU is stuck, which no unresolved event can tell.
"""

from __future__ import annotations

import os
import time

import torch


def _event():
    """A CUDA event that records a time stamp. (This module and mini3d/launch/devices.py are the
    only ones that call torch.cuda, tests/test_device_path.py; not devices.py, which the comm log
    cannot import: mini3d.launch's launcher imports the comm log.)"""
    return torch.cuda.Event(enable_timing=True)


def _side_stream():
    return torch.cuda.Stream()  # a stream of the current device that runs nothing but waits


def _on_stream(stream):
    return torch.cuda.stream(stream)  # context: `stream` is the current stream inside


def _synchronize():
    torch.cuda.synchronize()  # wait for all the GPU's queued work, every stream's


class HostClock:
    """perf_counter seconds (see the module docstring): marks are floats, nothing to resolve."""

    gpu = False

    def mark(self) -> float:
        return time.perf_counter()

    def span(self, timeline: list, start, action: str) -> None:
        """Append (start, now, action) to `timeline`."""
        timeline.append((start, time.perf_counter(), action))

    def resolve(self) -> None:
        pass


class Mark:
    """One CUDA timing event and the anchor of its step; `seconds` once the step is resolved."""

    __slots__ = ("event", "anchor", "epoch", "clock")

    def __init__(self, event, anchor, epoch, clock):
        self.event, self.anchor, self.epoch, self.clock = event, anchor, epoch, clock


class CudaClock:
    """CUDA-event timelines resolved once a step (see the module docstring)."""

    gpu = True

    def __init__(self):
        self.anchor = None  # (event, host perf_counter at its record) of the step being recorded
        self.epoch = 0  # resolves so far: a mark of an earlier epoch has completed
        self.timelines: list[list] = []  # timelines holding marks, converted by resolve()
        self._side = None  # the side stream collectives' ends are marked on (made on first use)
        # NCCL's blocking-wait mode makes every wait block the host: no early wait then
        self.blocking_wait = os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") not in ("0", "")

    def _anchor(self):
        if self.anchor is None:  # on the current (compute) stream, never on the side stream
            a = _event()
            a.record()
            self.anchor = (a, time.perf_counter())
        return self.anchor

    def mark(self) -> Mark:
        anchor = self._anchor()
        ev = _event()
        ev.record()  # the current stream: the work queued before this point precedes it
        return Mark(ev, anchor, self.epoch, self)

    def span(self, timeline: list, start, action: str) -> None:
        if not any(t is timeline for t in self.timelines):
            self.timelines.append(timeline)
        timeline.append((start, self.mark(), action))

    def mark_done(self, works, nccl: bool) -> Mark | None:
        """A mark the GPU passes when every Work in `works` has completed (NCCL: on the side
        stream, which waits for them); None on another backend or under NCCL's blocking wait
        (there a wait blocks the host): the op then keeps its host times."""
        if not nccl or self.blocking_wait:
            return None
        if self._side is None:
            self._side = _side_stream()
        self._anchor()
        with _on_stream(self._side):
            for w in works:
                w.wait()
            return self.mark()

    def seconds(self, m: Mark) -> float | None:
        """`m` in host seconds (module docstring), or None while its step is not resolved."""
        if m.epoch >= self.epoch:
            return None
        event, host = m.anchor
        return host + event.elapsed_time(m.event) / 1e3

    def resolve(self) -> None:
        """The step's one wait, then its timelines' marks as seconds (in place)."""
        if self.anchor is None:
            return  # nothing marked since the last resolve
        _synchronize()
        self.epoch, self.anchor = self.epoch + 1, None
        for tl in self.timelines:
            tl[:] = [(seconds_of(s), seconds_of(e), a) for s, e, a in tl]
        self.timelines = []


HOST = HostClock()
CUDA = CudaClock()  # one per process: a rank drives one GPU


def on_gpu(device) -> bool:
    return torch.device(device).type == "cuda"


def clock_for(device) -> HostClock | CudaClock:
    """The clock of timelines on `device`: CUDA events on a GPU, perf_counter elsewhere."""
    return CUDA if on_gpu(device) else HOST


def seconds_of(t):
    """A time stamp as seconds: a float as it is, a CUDA mark once resolved (else None)."""
    return t.clock.seconds(t) if isinstance(t, Mark) else t


__all__ = ["HostClock", "CudaClock", "Mark", "HOST", "CUDA", "clock_for", "on_gpu", "seconds_of"]
