"""Measured overlap (mini3d.diagnose.overlap): the hidden fraction of communication, from the event
log and the timeline.

A synthetic timeline pins the definition (intersection of each op's [issue, completion] with the
merged F / B / W intervals, over the in-flight seconds). One 2-rank launch (shared with the
ZeRO-2/3 reduce-scatter order tests below) checks it on real gloo traffic: a dp sync issued bucket
by bucket inside the backward is partly hidden (> 0), the same sync issued after the backward
(everything under no_sync, then finish_grad_sync) is not (0)."""

import contextlib
import time

import pytest
import torch

from mini3d.config import ModelConfig, Plan
from mini3d.diagnose.overlap import compute_intervals, measured_overlap, model_overlap
from mini3d.launch.launcher import launch


def ev(axis, op, start, end, shape=(1024,), step=0):
    return {"axis": axis, "op": op, "start": start, "end": end, "shape": shape,
            "context": {"step": step}}


def test_synthetic_timeline_gives_the_known_fractions():
    timeline = [(0.0, 1.0, "F0"), (1.0, 3.0, "B0"), (3.0, 3.5, "RECV_F1"), (3.5, 4.0, "F1"),
                (5.0, 6.0, "W0")]
    assert compute_intervals(timeline) == [(0.0, 3.0), (3.5, 4.0), (5.0, 6.0)]
    events = [ev("dp", "all_reduce", 2.0, 5.5),  # 1.0 (B0) + 0.5 (F1) + 0.5 (W0) of 3.5 hidden
              ev("dp_cp", "all_reduce", 2.0, 9.0, shape=(1,)),  # the loss average: not dp sync
              ev("pp", "send", 0.5, 1.5),  # all inside F0 / B0: hidden
              ev("pp", "recv", 3.0, 3.5),  # a blocking receive: the rank waits, exposed
              ev("pp", "send", 0.0, 9.0, step=1),  # another step: left out
              ev("tp", "all_reduce", 0.2, 0.3)]  # tp counts as compute, it is not measured
    got = measured_overlap(events, timeline, step=0)
    assert got["dp"]["n"] == 1 and got["dp"]["fraction"] == pytest.approx(2.0 / 3.5)
    assert got["dp"]["exposed_s"] == pytest.approx(1.5)
    assert got["pp"]["n"] == 2 and got["pp"]["fraction"] == pytest.approx(1.0 / 1.5)
    assert measured_overlap([], timeline)["dp"]["fraction"] == 0.0


def test_model_overlap_states_the_cost_model_assumption():
    from benchmarks.train_runs import TINY
    from mini3d.cost.hardware import PRESETS

    hw = PRESETS["A100-80GB"]
    many = Plan(dp=2, global_batch=8, seq_len=64, bucket_mb=0.01)  # all but the last bucket hide
    assert 0.0 < model_overlap(TINY, many, hw)["dp"] < 1.0
    assert model_overlap(TINY, many, hw)["pp"] is None
    one = Plan(dp=2, global_batch=8, seq_len=64)  # one bucket: it leaves with the last gradient
    assert model_overlap(TINY, one, hw)["dp"] == pytest.approx(0.0)
    pp = model_overlap(TINY, Plan(pp=2, micro_batches=4, global_batch=8, seq_len=64), hw)
    assert pp == {"dp": None, "pp": 0.0}


CFG = ModelConfig(2, 64, 4, 256, 64)


def overlap_worker():
    """One dp=2 step twice: sync inside the backward, then sync after it; the measured overlaps."""
    import torch.distributed as dist

    from mini3d.dp import make_dp
    from mini3d.grid import Grid, build_topology
    from mini3d.models.transformer import GPT

    topo = build_topology(Grid(dp=2), dist.get_rank())
    with topo.device:  # explicit: strict-device workers default to meta
        model = GPT(CFG, 0)
    plan = Plan(dp=2, global_batch=8, seq_len=64, bucket_mb=0.01)  # ~2.6k parameters per bucket
    net, opt = make_dp(model, topo.dp, plan, lambda p: torch.optim.SGD(p, lr=0.1))
    x = torch.randint(0, 256, (4, 64), device=topo.device)
    out = {}
    for step, mode in enumerate(("warm-up", "inside", "after")):  # warm-up: gloo connects
        dist.barrier()  # both ranks start the step together: little skew between them
        topo.log.context = {"step": step}
        t0 = time.perf_counter()
        with net.no_sync() if mode == "after" else contextlib.nullcontext():
            net(x, x).backward()
        timeline = [(t0, time.perf_counter(), "B0")]
        net.finish_grad_sync()
        opt.zero_grad()
        out[mode] = measured_overlap(topo.log.snapshot(), timeline, step=step)["dp"]
    return out


def overlap_and_zero_reductions_worker(stages):
    """overlap_worker(), then zero_reductions_worker(stage) for each stage, in the same processes."""
    return overlap_worker(), {stage: zero_reductions_worker(stage) for stage in stages}


@pytest.fixture(scope="module")
def two_rank_runs():
    """Every rank's (overlap_worker result, {stage: zero_reductions_worker result}) for ZeRO-2 and
    ZeRO-3: one 2-rank launch for the three runs (starting processes is most of their cost)."""
    return launch(overlap_and_zero_reductions_worker, 2, (2, 3), timeout=150)


@pytest.mark.timeout(180)
def test_dp_sync_inside_backward_is_hidden_after_it_is_not(two_rank_runs):
    for r, _ in two_rank_runs:
        inside, after = r["inside"], r["after"]
        assert inside["n"] > 3 and after["n"] == inside["n"]  # several buckets, both modes
        assert inside["fraction"] > 0.1, inside
        assert after["fraction"] == 0.0 and after["exposed_s"] > 0, after


def zero_reductions_worker(stage):
    """One dp=2 ZeRO-`stage` backward on several buckets: the [issue, wait] interval of each
    gradient reduce-scatter, in issue order (gloo: the event ends when the host waits for it)."""
    import torch.distributed as dist

    from mini3d.dp import make_dp
    from mini3d.grid import Grid, build_topology
    from mini3d.models.transformer import GPT

    topo = build_topology(Grid(dp=2), dist.get_rank())
    with topo.device:
        model = GPT(CFG, 0)
    plan = Plan(dp=2, zero=stage, global_batch=8, seq_len=64, bucket_mb=0.01)
    net, opt = make_dp(model, topo.dp, plan, lambda p: torch.optim.SGD(p, lr=0.1))
    x = torch.randint(0, 256, (4, 64), device=topo.device)
    first = len(topo.log.events)
    net(x, x).backward()
    net.finish_grad_sync()
    return [(e.start, e.end) for e in list(topo.log.events)[first:] if e.op == "reduce_scatter"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_reductions_wait_only_when_their_memory_is_needed(stage, two_rank_runs):
    """ZeRO-2/3 keep up to GRAD_BUCKETS_IN_FLIGHT (2) reduce-scatters in flight: each bucket's is
    waited only after the next bucket's was issued (at the first gradient of the one after), so it
    runs during the next bucket's backward; and never more than the bound are pending when one is
    issued. (With a bound of 1 every wait came before the next issue: this test fails.) Event
    order, not timing: each interval is [issue, the host's wait] as the event log records it."""
    from mini3d.dp.buckets import GRAD_BUCKETS_IN_FLIGHT

    assert GRAD_BUCKETS_IN_FLIGHT == 2
    for spans in (by_stage[stage] for _, by_stage in two_rank_runs):
        assert len(spans) > 4, spans  # several buckets (ZeRO-3: pieces of units)
        for (_, end), (nxt, _) in zip(spans, spans[1:]):
            assert end > nxt, spans  # waited after the next one was issued
        for i, (start, _) in enumerate(spans):
            pending = sum(1 for s, e in spans[:i] if e > start)
            assert pending <= GRAD_BUCKETS_IN_FLIGHT - 1, (i, spans)
