"""Zero-bubble, looped-BFS and relaxed interleaved schedules: PyTorch's orders, rules, bubbles, CLI.

PyTorch's schedule classes compute every rank's compute order (`pipeline_order`) in pure Python
from (p, m, v) alone, so the orders are compared without starting processes: the objects are made
without `__init__` (which wants real stages) and given the attributes the order methods read.
"""

import argparse
import json
from fractions import Fraction

import pytest

from mini3d.pp.rules import check
from mini3d.pp.schedules import Action, Schedule, make_schedule, schedule_problems
from mini3d.pp.simulator import bubble_formula, simulate

S = pytest.importorskip("torch.distributed.pipelining.schedules")
TORCH_CLASS = {"interleaved": "ScheduleInterleaved1F1B", "looped-bfs": "ScheduleLoopedBFS",
               "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
NAME = {"F": "F", "I": "B", "B": "B", "W": "W"}  # PyTorch's I (input backward) is mini3d's B


def torch_orders(kind: str, p: int, m: int, v: int) -> list[list[str]]:
    """PyTorch's per-rank compute order for (kind, p, m, v), printed as mini3d prints actions."""
    cls = getattr(S, TORCH_CLASS[kind])
    o = cls.__new__(cls)
    o.pp_group_size, o.n_local_stages, o._n_microbatches = p, v, m
    o.number_of_rounds = max(1, m // p)
    o.microbatches_per_round = m // o.number_of_rounds
    o.num_stages, o._stages = p * v, [None] * v
    o.pipeline_order = {r: o._calculate_single_rank_operations(r) for r in range(p)}
    if kind == "zb-h1":
        o.pipeline_order = o._add_bubbles_to_actions(p * v)
    return [[f"{NAME[a.computation_type.value]}{a.stage_index}.{a.microbatch_index}"
             for a in o.pipeline_order[r] if a is not None] for r in range(p)]


def _ours(kind, p, m, v):
    s = make_schedule(kind, p, m, v)
    return [[str(a) for a in s.compute(r)] for r in range(p)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,v", [("interleaved", 2), ("interleaved", 3), ("looped-bfs", 2),
                                    ("looped-bfs", 3), ("zb-h1", 1), ("zbv", 2)])
def test_orders_equal_pytorch(kind, v):
    n = 0
    for p in (2, 4, 8):
        for m in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16):
            if schedule_problems(kind, p, m, v):
                continue
            assert _ours(kind, p, m, v) == torch_orders(kind, p, m, v), (kind, p, m, v)
            n += 1
    assert n >= 12
    if kind == "interleaved":  # m not a multiple of p, as PyTorch allows (rounds of m // (m // p))
        assert _ours("interleaved", 4, 6, 2) == torch_orders("interleaved", 4, 6, 2)


def test_where_mini3d_refuses_on_purpose():
    # ZB-H1 is Qi et al.'s handcrafted schedule for m >= p; PyTorch's ScheduleInterleavedZeroBubble
    # (ZB1P, of which ZB-H1 is the v = 1 case) pads m < p with idle steps. mini3d has no
    # interleaved zero bubble (v > 1 with W): zbv is its two-chunk zero-bubble schedule.
    assert "zb-h1 needs micro_batches >= pp" in schedule_problems("zb-h1", 4, 2)[0]
    assert torch_orders("zb-h1", 4, 2, 1)[0][:2] == ["F0.0", "F0.1"]
    assert "virtual_stages=2 needs schedule" in schedule_problems("zb-h1", 4, 8, 2)[0]


def test_zbv_with_tied_embeddings_is_refused_by_the_plan():
    from mini3d.config import ModelConfig, Plan

    plan = Plan(pp=2, schedule="zbv", virtual_stages=2, micro_batches=4, global_batch=8)
    assert plan.problems(ModelConfig(n_layers=4)) == []
    msg = " ".join(plan.problems(ModelConfig(n_layers=4, tie_embeddings=True)))
    assert "schedule='zbv'" in msg and "tied embeddings" in msg and "zb-h1" in msg


def test_b_before_w_and_every_w_are_rules():
    s = make_schedule("zb-h1", 2, 3)
    acts = [list(a) for a in s.actions]
    i, j = acts[1].index(Action("B", 1, 0)), acts[1].index(Action("W", 1, 0))
    acts[1][i], acts[1][j] = acts[1][j], acts[1][i]
    bad = Schedule(s.kind, s.p, s.m, s.v, tuple(map(tuple, acts)), s.in_flight_bound)
    assert any(f"rank 1 step {i} (W1.0): needs ('B', 1, 0) earlier" in x for x in check(bad).problems)
    acts = [list(a) for a in s.actions]
    acts[0].remove(Action("W", 0, 2))
    lost = Schedule(s.kind, s.p, s.m, s.v, tuple(map(tuple, acts)), s.in_flight_bound)
    assert "W0.2 runs 0 times (expected 1)" in check(lost).problems
    # a W kept late keeps its activations: one more micro-batch alive than the bound allows
    acts = [list(a) for a in s.actions]
    acts[0].append(acts[0].pop(acts[0].index(Action("W", 0, 0))))
    late = Schedule(s.kind, s.p, s.m, s.v, tuple(map(tuple, acts)), s.in_flight_bound)
    assert any("3 micro-batches in flight exceeds the bound 2" in x for x in check(late).problems)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_h1_bubble_is_the_closed_form_and_below_1f1b(p):
    for m in (p, 2 * p, 3 * p):
        s, base = make_schedule("zb-h1", p, m), make_schedule("1f1b", p, m)
        for tf, tb, tw in ((1, 2, 1), (1, 2, Fraction(1, 2)), (1, 3, 1), (Fraction(3, 2), 2, 1)):
            tf, tb, tw = Fraction(tf), Fraction(tb), Fraction(tw)  # exact arithmetic
            got = simulate(s, tf, tb, t_w=tw).bubble_fraction
            assert got == bubble_formula("zb-h1", p, m, 1, tf, tb, tw), (p, m, tf, tb, tw)
            assert got < simulate(base, tf, tb).bubble_fraction
        # no weight work to defer: ZB-H1 degenerates to 1F1B's bubble
        assert simulate(s, Fraction(1), Fraction(2), t_w=0).bubble_fraction == \
            bubble_formula("1f1b", p, m)


def test_zbv_and_looped_bfs_bubbles():
    for p in (2, 4):
        for m in (2 * p, 4 * p):
            zbv = simulate(make_schedule("zbv", p, m, 2), Fraction(1, 2), 1).bubble_fraction
            assert zbv < simulate(make_schedule("1f1b", p, m), 1, 2).bubble_fraction
            assert zbv < bubble_formula("zb-h1", p, m)  # the V halves the fill and drain
            bfs = simulate(make_schedule("looped-bfs", p, m, 2), Fraction(1, 2), 1).bubble_fraction
            assert bfs == bubble_formula("looped-bfs", p, m, 2)


def _cli(argv):
    from mini3d.run.schedule_cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["schedule"] + argv).func(parser.parse_args(["schedule"] + argv))


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
def test_cli_prints_b_and_w_and_a_bubble_below_1f1b(kind, capsys):
    assert _cli(["--pp", "4", "--micro-batches", "8", "--schedule", kind]) == 0
    out = capsys.readouterr().out
    grid = out.split("check:")[0]
    assert " B0.0 " in grid and " W0.0 " in grid and "rank 3:" in grid
    assert "OK: rules hold" in out and "(B=1, W=1)" in out
    assert _cli(["--pp", "4", "--micro-batches", "8", "--schedule", kind, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["check"]["ok"]
    assert 0 < data["bubble_fraction"] < data["bubble_1f1b"] == pytest.approx(3 / 11)
