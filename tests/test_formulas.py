"""One source per formula: every place that needs one of mini3d's shared formulas calls its owner.

    ring factors (steps, wire bytes)   mini3d.comm.ring_steps / ring_wire_bytes
    seconds of one collective          mini3d.cost.hardware.Hardware.collective_s
    tp collectives of one layer        mini3d.tp.comm_per_layer
    closed-form bubble                 mini3d.schedule_kinds (ScheduleKind.bubble, .form)
    micro-batches in flight            mini3d.schedule_kinds (ScheduleKind.in_flight, .head_in_flight)
    bubble of a timeline               mini3d.pp.simulator.bubble_of (idle_gaps)
    layer partition                    mini3d.pp.partition.partition_layers
    vocabulary padding                 mini3d.tp.layers.padded_size
    model-state bytes per ZeRO stage   mini3d.cost.memory.model_state_bytes (STATE_BYTES)
    parameters / activations per stage mini3d.cost.params.stage_param_count / layer_activation_bytes
    ZeRO traffic per step (M mbs)      mini3d.cost.comm_time.zero_traffic_psi (counts: the stage
                                       objects, mini3d.dp.STAGES, via dp_collectives)

Each test asks the callers and checks they agree with the owner, on cases where a copied formula
would have drifted (n > 2 rings, uneven splits, interleaving). The last one checks that the
removed copies stay removed.
"""

from __future__ import annotations

import ast
from fractions import Fraction
import dataclasses
from pathlib import Path

import pytest

from mini3d.comm import ring_steps, ring_wire_bytes
from mini3d.config import PRESETS, Plan
from mini3d.cost.hardware import PRESETS as GPUS
from mini3d.cost.activations import inflight_microbatches
from mini3d.cost.params import stage_layers
from mini3d.pp.partition import partition_layers, stage_specs
from mini3d.pp.rules import check
from mini3d.pp.schedules import in_flight_bound, make_schedule
from mini3d.pp.simulator import bubble_formula

pytestmark = pytest.mark.timeout(60)
A100 = GPUS["A100-80GB"]


def test_ring_factors():
    # an all-reduce is a reduce-scatter then an all-gather: 2(n-1) steps of nbytes/n each
    assert [ring_steps("all_reduce", n) for n in (1, 2, 4, 8)] == [0, 2, 6, 14]
    assert ring_steps("all_gather", 8) == ring_steps("reduce_scatter", 8) == 7
    assert ring_steps("send", 2) == 1
    assert ring_wire_bytes("all_reduce", 4, 1000) == 1500 and ring_wire_bytes("all_gather", 4, 1000) == 750
    assert ring_wire_bytes("all_reduce", 3, 1000.0) == pytest.approx(4000 / 3)
    hw = dataclasses.replace(A100, latency_s=2e-6)
    assert hw.collective_s("all_reduce", 8, 8e6, 1e9) == pytest.approx(14 * 2e-6 + 14e6 / 1e9)
    assert hw.collective_s("all_reduce", 1, 8e6, 1e9) == 0.0


def test_collective_time_callers_agree():
    from mini3d.course.viz.comm import ring_allreduce_figure
    from mini3d.tp import comm_per_layer

    hw = dataclasses.replace(A100, latency_s=3e-6)
    fig = ring_allreduce_figure(1e8, [2, 4, 8], {"link": 100}, latency_s=3e-6)  # drawn from the owner
    assert list(fig.data[0].y) == pytest.approx([1e3 * hw.collective_s("all_reduce", n, 1e8, 100e9)
                                                 for n in (2, 4, 8)])
    for n in (2, 4, 8):
        for sp in (False, True):
            c = comm_per_layer(n, 2, 16, 64, sp, 2)
            for o in c["forward"] + c["backward"]:
                assert o["wire_bytes"] == ring_wire_bytes(o["op"], n, o["bytes"])


def test_cost_model_tp_and_dp_use_the_ring_factors():
    """The cost model's tp wire bytes are comm_per_layer's per layer plus the vocab ends and the loss;
    its dp time grows with 2(d-1) latencies per all-reduce bucket (not one per call)."""
    from mini3d.cost.model import estimate_cost
    from mini3d.tp import comm_per_layer

    cfg = PRESETS["gpt-1.3b"]
    plan = Plan(tp=4, global_batch=8, micro_batches=1, seq_len=1024, dtype="bf16")
    est = estimate_cost(cfg, plan, A100)
    c = comm_per_layer(4, 8, 1024, cfg.d_model, False, 2)
    act = 8 * 1024 * cfg.d_model * 2
    ends = 2 * ring_wire_bytes("all_reduce", 4, act) + ring_wire_bytes("all_reduce", 4, 12 * 8 * 1024)
    want = cfg.n_layers * (c["forward_wire_bytes"] + c["backward_wire_bytes"]) + ends
    assert est.comm_bytes["tp"] == pytest.approx(want, rel=1e-12)
    slow = dataclasses.replace(A100, latency_s=1e-3)
    dp = [estimate_cost(cfg, Plan(dp=d, global_batch=64, seq_len=1024, dtype="bf16", bucket_mb=1e6),
                        slow, n_gpus=d).breakdown["dp_total"] for d in (2, 8)]
    free = dataclasses.replace(A100, latency_s=0.0)
    base = [estimate_cost(cfg, Plan(dp=d, global_batch=64, seq_len=1024, dtype="bf16", bucket_mb=1e6),
                          free, n_gpus=d).breakdown["dp_total"] for d in (2, 8)]
    assert dp[0] - base[0] == pytest.approx(2 * 1e-3, rel=1e-6)  # one bucket, 2(2-1) steps
    assert dp[1] - base[1] == pytest.approx(14 * 1e-3, rel=1e-6)  # one bucket, 2(8-1) steps


@pytest.mark.parametrize("m", [1, 3, 8])
def test_zero_traffic_has_one_owner(m):
    """The cost model's dp wire bytes and chapter 03's formula column are zero_traffic_psi's Psi
    (2, 2, M + 1, 3M) times one ring share of the gradient bytes, on a 3-rank ring (float32: the
    gradient and parameter bytes are equal, as the paper's accounting assumes)."""
    from mini3d.cost.comm_time import dp_time, zero_traffic_psi
    from mini3d.course.viz.zero_traffic import zero_comm_rows

    cfg, n, d = PRESETS["tiny"], 3000, 3  # n a multiple of d: whole ring shares, no flooring
    psi = ring_wire_bytes("reduce_scatter", d, n * 4)
    assert [zero_traffic_psi(z, m) for z in range(4)] == [2, 2, m + 1, 3 * m]
    for z in range(4):
        plan = Plan(dp=d, zero=z, micro_batches=m, global_batch=3 * m, dtype="float32")
        wire = dp_time(cfg, plan, A100, n, 1e9, 0.0, 1.0)[2]
        assert wire == pytest.approx(zero_traffic_psi(z, m) * psi, rel=1e-12)
    rows = zero_comm_rows({z: {"comm_wire_bytes": {}} for z in range(4)}, n * 4, d, 1, micro_batches=m)
    assert [r["formula_psi"] for r in rows] == [zero_traffic_psi(z, m) for z in range(4)]


def test_zero_stage_objects_are_what_the_traffic_counts():
    """The cost model counts a stage's collectives from the stage object's own answers (what it
    shards, its collective, when it reduces, how parameters come back: mini3d.dp.stage), and the
    traffic owner turns them into the paper's Psi: a stage that changed its answer would change
    the estimate with it, with no second table to forget."""
    from mini3d.cost.comm_time import dp_collectives, zero_traffic_psi
    from mini3d.dp import STAGES, zero_stage

    assert [STAGES[z].shards for z in range(4)] == [
        (), ("optimizer_states",), ("optimizer_states", "gradients"),
        ("optimizer_states", "gradients", "parameters")]
    assert [s.reduce_op for s in STAGES.values()] == ["all_reduce"] + ["reduce_scatter"] * 3
    assert [s.reduces_every_micro_batch for s in STAGES.values()] == [False, False, True, True]
    assert [s.param_gather for s in STAGES.values()] == ["never", "after_step", "after_step", "per_unit"]
    for m in (1, 3):
        assert [dp_collectives(z, m) for z in range(4)] == [(1, 0), (1, 1), (m, 1), (m, 2 * m)]
        assert [zero_traffic_psi(z, m) for z in range(4)] == [2, 2, m + 1, 3 * m]
    with pytest.raises(ValueError, match="zero=4"):
        zero_stage(4)


@pytest.mark.parametrize("extra", [0, 1])
def test_zero1_grader_budget_is_the_traffic_owner(extra):
    """Chapter 03's ZeRO-1 exercise passes a learner at zero_traffic_psi(1, 1) Psi per step and
    fails one byte above it (the grader's budget is the owner's, not its own 2)."""
    from types import SimpleNamespace

    from mini3d.cost.comm_time import zero_traffic_psi
    from mini3d.course.grading.core import CheckFailed
    from mini3d.course.grading.data_parallel import zero1_traffic

    n, d = 3000, 3
    psi = 4 * n * (d - 1) // d  # one ring pass over the flat fp32 vector (n divides by d)
    rec = {"dp": d, "n": n, "gathers": [1], "wire": [zero_traffic_psi(1, 1) * psi + extra],
           "ops": [{"reduce_scatter": 1, "all_gather": 1}]}
    ctx = SimpleNamespace(results=[{"steps": rec}])
    if extra:
        with pytest.raises(CheckFailed, match="2 psi"):
            zero1_traffic(ctx)
    else:
        zero1_traffic(ctx)


CASES = [("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("1f1b", 3, 3, 1), ("interleaved", 2, 4, 2),
         ("interleaved", 4, 8, 3)]


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_bubble_and_in_flight_have_one_owner(kind, p, m, v):
    from mini3d.cost.model import bubble_fraction
    from mini3d.course.viz.pipeline import bubble_formula_text
    from mini3d.run.dryrun import bubble_line

    b = bubble_formula(kind, p, m, v)
    assert bubble_fraction(kind, p, m, v) == pytest.approx(float(b), rel=1e-12)  # simulator = formula
    assert f"{b.numerator}/{b.denominator}" in bubble_line(Plan(pp=p, micro_batches=m, virtual_stages=v,
                                                                schedule=kind, global_batch=m))
    assert f"{b.numerator}/{b.denominator}" in bubble_formula_text(kind, p, m, v)
    sched = make_schedule(kind, p, m, v)
    result = check(sched)
    assert result.ok
    plan = Plan(pp=p, micro_batches=m, virtual_stages=v, schedule=kind, global_batch=m)
    for r in range(p):
        bound = in_flight_bound(kind, p, m, v, r)
        assert sched.in_flight_bound[r] == bound
        assert inflight_microbatches(plan, r) == pytest.approx(bound / v)
    assert result.peak_in_flight == list(sched.in_flight_bound)  # the bound is reached


@pytest.mark.parametrize("kind,p,m,v", CASES + [("zb-h1", 4, 6, 1), ("zbv", 3, 5, 2), ("looped-bfs", 2, 3, 2)])
def test_timeline_bubble_and_head_in_flight_have_one_owner(kind, p, m, v):
    """The course's bubble of a drawn (or measured) timeline is the simulator's, exactly on a
    simulated one; the estimator's head micro-batches and its zbv text are the registry's."""
    from mini3d.cost.activations import head_microbatches
    from mini3d.course.viz.pipeline import bubble_from_timeline, bubble_formula_text, idle_gaps
    from mini3d.pp.simulator import simulate
    from mini3d.run.dryrun import bubble_line
    from mini3d.schedule_kinds import schedule_kind

    sim = simulate(make_schedule(kind, p, m, v), Fraction(1, v), Fraction(2, v))
    assert bubble_from_timeline(sim.timeline) == pytest.approx(float(sim.bubble_fraction), rel=1e-12)
    idle = sum(e - s for row in idle_gaps(sim.timeline) for s, e in row)
    assert idle == pytest.approx(float(p * sim.makespan - sum(sim.busy)), rel=1e-12)
    plan = Plan(pp=p, micro_batches=m, virtual_stages=v, schedule=kind, global_batch=m)
    assert head_microbatches(plan) == schedule_kind(kind).head_in_flight(p, m)
    text = bubble_formula_text(kind, p, m, v)
    assert text in bubble_line(plan) and f"{float(sim.bubble_fraction):.1%}" in text


def test_layer_partition_has_one_owner():
    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=7)
    plan = Plan(pp=3, global_batch=3, micro_batches=3)
    specs = stage_specs(7, 3)
    for r in range(3):
        assert stage_layers(cfg, plan, r) == [i for s in specs if s.pp_rank == r for i in s.layers]
    assert [len(x) for x in partition_layers(7, 3)] == [3, 2, 2]


def test_removed_copies_stay_removed():
    """The old second copies of shared formulas are not defined anywhere in the package (ZERO_PSI
    was chapter 03's table of ZeRO traffic at one micro-batch; FORMS the course's bubble texts,
    gpipe_timeline its closed-form GPipe timeline, zbv_peak ZB-V's in-flight count on its order)."""
    gone = {"padded_vocab", "chunk_layers", "closed_form_bubble", "_layers_per_chunk", "ZERO_PSI",
            "FORMS", "gpipe_timeline", "zbv_peak"}
    root = Path(__file__).resolve().parents[1] / "mini3d"
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in gone:
                found.append(f"{path.relative_to(root)}: {node.name}")
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in gone for t in node.targets):
                found.append(f"{path.relative_to(root)}: {node.targets[0].id}")
    assert not found


def test_collective_across_nodes_takes_the_faster_of_ring_and_tree():
    """Across nodes every ring step waits for the network; an all-reduce takes NCCL's tree when
    that is faster (small messages, many ranks), the ring otherwise; inside a node, the ring."""
    n, k, bw = 1024, 8, 200e9
    ring = ring_steps("all_reduce", n) * A100.internode_latency_s + ring_wire_bytes("all_reduce", n, 1e6) / bw
    small = A100.collective_s("all_reduce", n, 1e6, bw, k)
    assert small == pytest.approx(A100.tree_allreduce_s(n, 1e6, bw, k)) and small < ring / 10
    # 2 nodes, 1 GB: the ring's 2(n-1)/n of the bytes beats the tree's 2x
    ring16 = ring_steps("all_reduce", 16) * A100.internode_latency_s + ring_wire_bytes("all_reduce", 16, 1e9) / bw
    assert A100.collective_s("all_reduce", 16, 1e9, bw, 8) == pytest.approx(ring16)
    # a reduce-scatter across nodes is a ring (NCCL has no tree for it); inside a node, as before
    assert A100.collective_s("reduce_scatter", 16, 1e6, bw, 8) == pytest.approx(
        15 * A100.internode_latency_s + ring_wire_bytes("reduce_scatter", 16, 1e6) / bw)
    assert A100.collective_s("all_reduce", 8, 1e6, bw, 8) == A100.collective_s("all_reduce", 8, 1e6, bw)


def test_bytes_per_parameter_have_one_owner():
    """state_bytes is the rule (bf16 with mini3d's fp32 gradients: 2 + 4 + 12 = 18); the
    estimator, the planner's sentence and the memory exercise's grader read it."""
    from mini3d.course.grading.memory import _PER
    from mini3d.cost.memory import estimate_memory, state_bytes
    from mini3d.cost.model import estimate_cost
    from mini3d.cost.planner import why_not

    assert state_bytes("bf16") == (2, 4, 12) and state_bytes("bf16", "bf16") == (2, 2, 12)
    assert tuple(_PER["bf16"].values()) == state_bytes("bf16") and tuple(_PER["float32"].values()) == (4, 4, 8)
    cfg = PRESETS["gpt-1.3b"]
    est = estimate_memory(cfg, Plan(dtype="bf16", global_batch=1, seq_len=128))
    assert (est.params, est.grads, est.optimizer) == tuple(b * est.n_params for b in state_bytes("bf16"))
    big = estimate_cost(PRESETS["gpt-70b"], Plan(tp=8, dtype="bf16", global_batch=1, seq_len=128), A100)
    assert not big.fits and "2+4+12 = 18 bytes each" in why_not(big)


def test_the_loss_average_is_one_owner_s_8_bytes(monkeypatch):
    """The logged loss averaged over cp x dp is one `dp.loss.LOSS_DTYPE` element, `LOSS_BYTES` (8):
    what `mean_over_replicas` sends (the trainer's only way to average it) and what the host-share
    cost model charges; neither the trainer nor the cost model restates the dtype or the 8."""
    from types import SimpleNamespace

    import torch

    from mini3d import comm
    from mini3d.dp.loss import LOSS_BYTES, LOSS_DTYPE, mean_over_replicas

    assert LOSS_BYTES == 8 == torch.zeros(1, dtype=LOSS_DTYPE).nbytes
    sent = []
    monkeypatch.setattr(comm, "all_reduce", lambda t, axis, op: sent.append((t.dtype, t.nbytes, op)))
    assert mean_over_replicas(2.5, SimpleNamespace(size=2), "cpu") == 2.5
    assert sent == [(LOSS_DTYPE, LOSS_BYTES, "avg")]
    root = Path(__file__).resolve().parents[1] / "mini3d"
    assert "mean_over_replicas(" in (root / "run" / "train.py").read_text()
    assert "float64" not in (root / "run" / "train.py").read_text()
    calls = [n for n in ast.walk(ast.parse((root / "cost" / "host_share.py").read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "collective_s"]
    assert calls and all(ast.unparse(c.args[2]) == "LOSS_BYTES" for c in calls)
