"""The shared-host step simulation (`mini3d.cost.host_share`) against hand-worked cases.

Processor sharing: R runnable processes on C cores each advance at min(1, C/R) / contention
alone-speed seconds per second, and a process waiting for its input takes no core."""

import pytest

from mini3d.config import Plan
from mini3d.cost.host_share import rate, shared_makespan
from mini3d.cost.model import estimate_cost
from mini3d.pp.schedules import make_schedule
from mini3d.pp.simulator import simulate

from benchmarks.train_runs import TINY
from mini3d.cost.hardware import Hardware

CPU = Hardware("cpu-test", peak_flops=50e9, memory_bytes=8e9, memory_bw=10e9, nvlink_bw=1e9,
               internode_bw=1e9, gpus_per_node=2, latency_s=1e-4, eff_max=1.0,
               eff_half_width=100.0, shared_host=True)


def test_rate_is_fair_share_of_the_cores():
    assert rate(1, 2) == 1.0 and rate(2, 2) == 1.0
    assert rate(8, 2) == pytest.approx(0.25) and rate(8, 2, contention=2.0) == pytest.approx(0.125)


def test_enough_cores_gives_the_pipeline_simulators_makespan():
    """With a core per process nothing is shared: the result is the ordinary schedule timing."""
    for kind, p, m in [("1f1b", 2, 4), ("gpipe", 3, 3), ("zb-h1", 2, 4)]:
        sch = make_schedule(kind, p, m)
        ref = simulate(sch, 1.0, 2.0)
        split = sch.split
        work = {"F": [1.0] * p, "B": [1.0 if split else 2.0] * p, "W": [1.0] * p}
        out = shared_makespan(sch, work, [1] * p, cores=p)
        assert out["makespan"] == pytest.approx(float(ref.makespan)), kind


def test_one_core_is_work_conserving():
    """On one core the step takes all processes' work added up: a pipeline's idle rank lends its
    core to the others, so the bubble costs nothing (a per-rank slowdown would charge it)."""
    sch = make_schedule("1f1b", 2, 4)
    work = {"F": [1.0, 1.0], "B": [2.0, 2.0], "W": [0.0, 0.0]}
    out = shared_makespan(sch, work, [3, 3], cores=1)  # 3 processes per pipeline rank
    assert out["makespan"] == pytest.approx(3 * 2 * 4 * 3.0)  # 6 processes x 4 mbs x (F + B)
    slowed = shared_makespan(sch, work, [3, 3], cores=1, contention=1.5)
    assert slowed["makespan"] == pytest.approx(1.5 * out["makespan"])


def test_two_cores_between_the_bounds():
    """2 pipeline ranks of 2 processes on 2 cores: when both ranks run, each process gets half a
    core; in the warm-up and drain the one running rank has a core per process."""
    sch = make_schedule("1f1b", 2, 2)
    work = {"F": [1.0, 1.0], "B": [2.0, 2.0], "W": [0.0, 0.0]}
    out = shared_makespan(sch, work, [2, 2], cores=2)
    alone = float(simulate(sch, 1.0, 2.0).makespan)  # a core per process
    assert alone < out["makespan"] < 2 * alone
    assert out["makespan"] >= 2 * 2 * 2 * 3.0 / 2  # total work over the cores


def test_messages_cost_both_ends_and_the_tail_runs_after():
    sch = make_schedule("gpipe", 2, 1)
    work = {"F": [1.0, 1.0], "B": [2.0, 2.0], "W": [0.0, 0.0]}
    base = shared_makespan(sch, work, [1, 1], cores=2)["makespan"]  # F0 F1 B1 B0 in a chain
    assert base == pytest.approx(6.0)
    msg = shared_makespan(sch, work, [1, 1], cores=2, recv=0.1, send=0.2, after=[0.5, 0.0])
    # two messages on the chain, each a send and a receive; rank 0's tail after its last B
    assert msg["makespan"] == pytest.approx(6.0 + 2 * 0.3 + 0.5)


def test_blocked_waits_take_no_core():
    """A wait after an action holds its rank back, but the other rank gets the cores meanwhile."""
    sch = make_schedule("gpipe", 2, 1)
    work = {"F": [1.0, 1.0], "B": [2.0, 2.0], "W": [0.0, 0.0]}
    waits = {"F": [0.5, 0.5], "B": [0.0, 0.0], "W": [0.0, 0.0]}
    out = shared_makespan(sch, work, [1, 1], cores=1, blocked=waits, recv_wait=0.25)
    # a chain: F0, wait, (receive wait) F1, wait, B1, (receive wait) B0
    assert out["makespan"] == pytest.approx(6.0 + 2 * 0.5 + 2 * 0.25)
    # two independent ranks on one core: while one waits the other runs at full speed
    two = make_schedule("gpipe", 1, 2)
    alone = shared_makespan(two, {"F": [1.0], "B": [1.0], "W": [0.0]}, [2], cores=1)
    assert alone["makespan"] == pytest.approx(2 * 2 * 2.0)
    waited = shared_makespan(two, {"F": [1.0], "B": [1.0], "W": [0.0]}, [2], cores=1,
                             blocked={"F": [1.0], "B": [0.0], "W": [0.0]})
    assert waited["makespan"] == pytest.approx(2 * 2 * 2.0 + 2 * 1.0)  # one group: nobody fills


def test_cost_model_on_a_shared_host_uses_the_simulation():
    """A one-core host: the 3D layout's 8 processes cannot beat their summed work, however the
    per-rank terms would divide it; a GPU preset never takes this path."""
    import dataclasses

    one = dataclasses.replace(CPU, gpus_per_node=1)
    plan = Plan(tp=2, pp=2, dp=2, micro_batches=2, global_batch=8, seq_len=64)
    est = estimate_cost(TINY, plan, one)
    assert "host_sharing" in est.breakdown
    single = estimate_cost(TINY, Plan(micro_batches=2, global_batch=8, seq_len=64), one)
    assert est.step_time_s > single.step_time_s  # same work, plus the tp / pp communication
    from mini3d.cost.hardware import PRESETS as GPUS
    assert "host_sharing" not in estimate_cost(TINY, plan, GPUS["A100-80GB"]).breakdown
