"""Timelines on CUDA use the GPU's times (issue #34 item 5), mocked on CPU: no GPU runs here.

The stand-in (`FakeGpu`): `torch.cuda.Event`, `Stream`, `stream` and `synchronize` replaced by a
GPU whose streams each keep their own clock: every recorded event stands for `work` seconds of
kernels queued before it on its stream (so the GPU lags the host by far more than the launches
take), a Work's `wait()` makes the current stream wait until the op's completion time, and
`elapsed_time` fails, as CUDA's does, for an event recorded since the last synchronize. CPU tensors
pass for CUDA ones only where the clock is chosen (`timeline_clock.on_gpu`). The checks: the
pipeline runtime's and the trainer's timelines hold the fake GPU's times on the host's seconds
scale (not launch times), a collective's end is its completion on the GPU while its host times
stay for the watchdog, and a step makes one synchronize, at its read-back. The CPU path is the
existing tests' (test_pp_local, test_overlap, the course figures).
"""

from __future__ import annotations

import contextlib
import time
import types

import pytest
import torch

from mini3d import comm, timeline_clock
from mini3d.comm_log import CommLog
from mini3d.config import ModelConfig
from mini3d.grid import Grid, build_topology
from mini3d.pp.partition import build_stages
from mini3d.pp.runtime import PipelineRuntime
from mini3d.pp.schedules import make_schedule
from mini3d.run.records import timed
from mini3d.run.train import read_back

WORK = 0.5  # GPU seconds of kernels before each recorded event (the host launches in microseconds)


class FakeGpu:
    def __init__(self):
        self.clocks = {"compute": 100.0}  # stream -> its GPU time (an arbitrary origin)
        self.stream, self.unfinished, self.syncs, self.syncs_at = "compute", set(), 0, []


def fake_cuda(monkeypatch) -> FakeGpu:
    gpu = FakeGpu()

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self, stream=None):
            if gpu.stream == "compute":  # a side stream runs no kernels of its own
                gpu.clocks[gpu.stream] += WORK
            self.t, self.stream = gpu.clocks[gpu.stream], gpu.stream
            gpu.unfinished.add(self)
            gpu.syncs_at.append(gpu.syncs)  # how many syncs had happened when this was recorded

        def elapsed_time(self, end):
            if self in gpu.unfinished or end in gpu.unfinished:
                raise RuntimeError("CUDA error: device not ready (event not completed)")
            return (end.t - self.t) * 1e3

    @contextlib.contextmanager
    def on(stream):
        before, gpu.stream = gpu.stream, stream
        gpu.clocks.setdefault(stream, gpu.clocks["compute"])
        try:
            yield
        finally:
            gpu.stream = before

    def synchronize():
        gpu.syncs += 1
        gpu.unfinished.clear()

    side = iter(f"side{i}" for i in range(100))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: next(side))
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(timeline_clock, "on_gpu", lambda device: True)  # CPU tensors pass for CUDA
    monkeypatch.setattr(timeline_clock, "CUDA", timeline_clock.CudaClock())
    return gpu


class FakeWork:
    """An NCCL-like Work that completes on the GPU at `done` (fake GPU seconds)."""

    def __init__(self, gpu, done):
        self.gpu, self.done, self.waited_on = gpu, done, []

    def wait(self):  # orders the current stream after the op; the host does not block
        g = self.gpu
        g.clocks[g.stream] = max(g.clocks[g.stream], self.done)
        self.waited_on.append(g.stream)

    def is_completed(self):
        return True


CFG = ModelConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=32, max_seq_len=8)


@pytest.mark.timeout(60)
def test_the_pipeline_timeline_holds_the_gpus_times_resolved_at_the_read_back(monkeypatch):
    gpu = fake_cuda(monkeypatch)
    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))
           for _ in range(3)]
    topo = build_topology(Grid(), 0, make_groups=False)
    sched = make_schedule("1f1b", 1, 3, 1)
    rt = PipelineRuntime(build_stages(CFG, 3, 0, 1, 1, placement=sched.placement), sched, topo,
                         (2, 8, CFG.d_model))
    host0 = time.perf_counter()
    res = rt.step(mbs, step=0)
    host1 = time.perf_counter()
    assert gpu.syncs == 1 and set(gpu.syncs_at) == {0}  # one synchronize, after every mark
    tl = res.timeline
    assert [a for _, _, a in tl] == ["F0.0", "B0.0", "F0.1", "B0.1", "F0.2", "B0.2"]  # stage.mb
    anchor_host = tl[0][0] - WORK  # the anchor is the step's first event, stamped by the host
    assert host0 <= anchor_host <= host1
    for i, (s, e, a) in enumerate(tl):  # the GPU's times: WORK per action, not the launches' µs
        assert s == pytest.approx(anchor_host + WORK * (2 * i + 1), abs=1e-9), a
        assert e - s == pytest.approx(WORK, abs=1e-9), a
    assert tl[-1][1] - host1 > 2.0  # the GPU lags the host: its times run past the host's
    assert all(isinstance(x, float) for s, e, _ in tl for x in (s, e))
    rt.step(mbs, step=1)
    assert gpu.syncs == 2  # one a step


@pytest.mark.timeout(60)
def test_the_trainers_timeline_resolves_in_read_back_with_one_synchronize(monkeypatch):
    gpu = fake_cuda(monkeypatch)
    timeline = []
    loss = timed(timeline, "F0", lambda: torch.ones(()) * 2, "cuda")
    timed(timeline, "B0", lambda: None, "cuda")
    assert gpu.syncs == 0 and all(isinstance(s, timeline_clock.Mark) for s, _, _ in timeline)
    got = read_back(loss, None, None)  # the step's read-back (mini3d.run.train)
    assert got == (2.0, None, 0) and gpu.syncs == 1
    (s0, e0, _), (s1, e1, _) = timeline
    assert (e0 - s0, s1 - e0, e1 - s1) == pytest.approx((WORK, WORK, WORK), abs=1e-9)
    read_back(loss, None, None)
    assert gpu.syncs == 1  # nothing marked since: no second wait


@pytest.mark.timeout(60)
def test_a_collectives_gpu_end_is_its_completion_and_its_host_times_stay(monkeypatch):
    """An async all-reduce issued at GPU time ~100.5 completes at 104.0 while the compute stream
    runs on; its end is marked on the clock's side stream (the compute stream is not held), and
    its wait on the compute stream comes later (105.0): the event's `end` is 104.0 on the host
    scale, the host's times stay on the Event (the watchdog's) and under host_start / host_end."""
    gpu = fake_cuda(monkeypatch)
    works = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, op=None, group=None, async_op=False: works.append(
                            FakeWork(gpu, 104.0)) or works[-1])
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    log = CommLog(0)
    axis = types.SimpleNamespace(name="dp", ranks=(0, 1), size=2, index=0, group="g", log=log,
                                 device=None)
    host0 = time.perf_counter()
    work = comm.all_reduce(torch.ones(4), axis, async_op=True)
    assert works[0].waited_on == ["side0"]  # at issue: the side stream waits, not the compute one
    clock = timeline_clock.CUDA
    timeline = []
    for i in range(4):  # compute queued behind the op: 4 x 2 marks of WORK each
        clock.span(timeline, clock.mark(), f"B{i}")
    work.wait()  # mini3d's wait: the compute stream now waits (already past 104.0)
    assert works[0].waited_on == ["side0", "compute"]
    host1 = time.perf_counter()
    assert gpu.syncs == 0
    ev = log.events[-1]
    assert host0 <= ev.start <= ev.end <= host1  # the host's clock, for the watchdog
    assert log.snapshot()[-1]["start"] == ev.start  # unresolved: the snapshot keeps the host's
    clock.resolve()
    d = log.snapshot()[-1]
    anchor_host, anchor_gpu = d["start"] - WORK, 100.0 + WORK  # the anchor, then the op's start
    assert host0 <= anchor_host <= host1
    assert d["end"] == pytest.approx(anchor_host + (104.0 - anchor_gpu), abs=1e-9)
    assert (d["host_start"], d["host_end"]) == (ev.start, ev.end)
    assert timeline[-1][1] > d["end"]  # the compute ran on past the op's completion


@pytest.mark.timeout(60)
def test_the_cpu_clock_is_perf_counter_and_resolves_nothing():
    clock = timeline_clock.clock_for("cpu")
    assert clock is timeline_clock.HOST and not clock.gpu
    t0 = time.perf_counter()
    timeline = []
    timed(timeline, "F0", lambda: None)
    (s, e, a), = timeline
    assert t0 <= s <= e <= time.perf_counter() and a == "F0"
    log = CommLog(0)
    eid, ev = log.begin(types.SimpleNamespace(name="dp", ranks=(0, 1)), "all_reduce",
                        torch.ones(2), 8, 8)
    log.end(eid, ev)
    assert ev.gpu_start is None and set(log.snapshot()[-1]) == set(ev.__slots__) - {"gpu_start",
                                                                                  "gpu_end"}


@pytest.mark.timeout(60)
def test_what_a_run_collects_is_resolved_first(monkeypatch):
    """`collected` (the end of train_worker) resolves marks made after the last read-back (a
    validation pass's collectives): what it returns holds seconds, which pickle to the launcher."""
    from mini3d.run.records import collected

    gpu = fake_cuda(monkeypatch)
    log = CommLog(0)
    eid, ev = log.begin(types.SimpleNamespace(name="dp", ranks=(0, 1)), "all_reduce",
                        torch.ones(2), 8, 8)
    log.end(eid, ev)
    trainer = types.SimpleNamespace(topo=types.SimpleNamespace(device="cuda", log=log),
                                    last_result=None, last_timeline=[])
    timed(trainer.last_timeline, "F0", lambda: None, "cuda")
    got = collected(trainer, {"events", "timeline"})
    assert gpu.syncs == 1 and all(isinstance(x, float) for s, e, _ in got["timeline"] for x in (s, e))
    assert got["events"][-1]["start"] == ev.start  # no GPU end (not issued through comm): host's
