"""Pure tests of pipeline schedules: rules, deadlock proof, simulator closed forms, partition, CLI."""

import argparse
import json
from fractions import Fraction

import pytest

from mini3d.config import ModelConfig, Plan
from mini3d.pp.partition import local_specs, partition_layers, stage_specs
from mini3d.pp.rules import check
from mini3d.pp.schedules import Action, Schedule, make_schedule, schedule_problems
from mini3d.pp.simulator import Stuck, bubble_formula, simulate


def _cases():
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 3, 4, 5, 8, 12, 16):
            for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3),
                            ("interleaved", 4), ("looped-bfs", 2), ("zb-h1", 1), ("zbv", 2)):
                if not schedule_problems(kind, p, m, v):
                    yield kind, p, m, v


CASES = list(_cases())


def _edit(s: Schedule, rank: int, fn) -> Schedule:
    acts = [list(a) for a in s.actions]
    fn(acts[rank])
    return Schedule(s.kind, s.p, s.m, s.v, tuple(tuple(a) for a in acts), s.in_flight_bound)


@pytest.mark.timeout(60)
def test_every_generated_schedule_obeys_the_rules_and_cannot_deadlock():
    assert len(CASES) > 200
    for kind, p, m, v in CASES:
        s = make_schedule(kind, p, m, v)
        res = check(s)
        assert res.ok, (kind, p, m, v, str(res))
        assert s.n_stages == p * v
        per_mb = 3 if kind in ("zb-h1", "zbv") else 2  # F, B (and W when split)
        assert sum(a.is_compute for acts in s.actions for a in acts) == per_mb * p * v * m
        assert s.split == (per_mb == 3)
        if kind == "gpipe":
            assert res.peak_in_flight == [m] * p
        if kind == "1f1b":
            assert res.peak_in_flight == [min(p - r, m) for r in range(p)]
            assert max(res.peak_in_flight) <= p
        if kind == "zb-h1":  # 1F1B's peak p on every rank; rank r's W run r micro-batches late
            assert res.peak_in_flight == [min(p, m)] * p
            assert res.peak_awaiting_w == [min(r + 1, m) for r in range(p)]
        if kind == "zbv":  # two chunks of half the layers each: 2p chunks = p micro-batches
            assert max(res.peak_in_flight) <= 2 * p
            assert s.stages_of(0) == [0, 2 * p - 1]


def test_interleaved_round_robin_and_megatron_order():
    s = make_schedule("interleaved", 2, 4, 2)
    assert s.stages_of(0) == [0, 2] and s.stages_of(1) == [1, 3]
    # rank 0 warm-up = 2 (p - 1) + (v - 1) p = 4 forwards: p micro-batches through chunk 0, then chunk 1
    assert [str(a) for a in s.compute(0)[:5]] == ["F0.0", "F0.1", "F2.0", "F2.1", "F0.2"]
    assert [str(a) for a in s.compute(1)[:4]] == ["F1.0", "F1.1", "F3.0", "B3.0"]


def test_transfers_pair_up_with_peers_and_print():
    s = make_schedule("1f1b", 2, 3)
    assert [str(a) for a in s.actions[0][:2]] == ["F0.0", "sF0.0>1"]
    assert [str(a) for a in s.actions[1][:2]] == ["rF1.0<0", "F1.0"]
    grid = s.format_grid()
    assert grid.splitlines()[1].split()[2:4] == ["F0.0", "F0.1"]
    assert "." in grid.splitlines()[2]  # rank 1 idles in step 0: the bubble is visible
    assert "sF0.0>1" in s.format_grid(transfers=True)


def test_swapped_recv_order_is_a_deadlock_named_by_rank_and_step():
    s = make_schedule("1f1b", 2, 3)
    # rank 0 list: F0.0 sF0.0>1 F0.1 sF0.1>1 rB0.0<1 ...; let rank 0 wait for the backward before
    # sending micro-batch 1, while rank 1 waits for micro-batch 1 before its first backward.
    acts = [str(a) for a in s.actions[0]]
    i = acts.index("sF0.1>1")
    assert acts[i + 1] == "rB0.0<1"

    def swap(a):
        a[i], a[i + 1] = a[i + 1], a[i]

    res = check(_edit(s, 0, swap))
    assert not res.ok and res.deadlock is not None
    assert res.deadlock.startswith(f"deadlock at rank 0 step {i}:"), res.deadlock
    assert f"rank 0 step {i} (rB0.0<1)" in res.deadlock and "rank 1 step 2 (rF1.1<0)" in res.deadlock


def test_both_neighbours_sending_first_deadlocks_under_blocking_semantics():
    # rank 0 sends micro-batch 1 forward while rank 1 sends micro-batch 0's gradient back, and each
    # receives only afterwards: fine with buffered sends, a hang with blocking ones.
    s = make_schedule("1f1b", 2, 3)
    r1 = [str(a) for a in s.actions[1]]
    j = r1.index("rF1.1<0")

    def move(a):
        a.insert(r1.index("sB1.0>0"), a.pop(j))  # receive after sending

    res = check(_edit(s, 1, move))
    assert not res.ok and "blocks sending to rank 0" in res.deadlock
    assert "blocks sending to rank 1" in res.deadlock


def test_rule_violations_are_named():
    s = make_schedule("gpipe", 2, 2)
    bad = _edit(s, 1, lambda a: a.reverse())  # backwards before forwards on rank 1
    problems = "\n".join(check(bad).problems)
    assert "rank 1 step 0 (sB1.1>0): needs ('B', 1, 1) earlier on rank 1" in problems
    dropped = _edit(s, 0, lambda a: a.remove(Action("SEND_F", 0, 1, 1)))
    res = check(dropped)
    assert any("0 send(s) but 1 receive(s)" in x for x in res.problems)
    wrong_mb = _edit(s, 1, lambda a: a.__setitem__(0, Action("RECV_F", 1, 1, 0)))
    assert any("mismatch" in x or "duplicate" in x for x in check(wrong_mb).problems)
    over = Schedule(s.kind, s.p, s.m, s.v, s.actions, (1, 1))
    assert any("exceeds the bound 1" in x for x in check(over).problems)


@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                    ("interleaved", 4)])
def test_simulated_bubble_equals_closed_form_exactly(kind, v):
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p):
            s = make_schedule(kind, p, m, v)
            for tf, tb in ((1, 1), (1, 2), (3, 1)):  # per-chunk costs t / v, exact Fractions
                r = simulate(s, Fraction(tf, v), Fraction(tb, v))
                assert r.bubble_fraction == bubble_formula(kind, p, m, v), (kind, p, m, v, tf, tb)
                assert r.makespan == (m + Fraction(p - 1, v)) * (tf + tb)
    assert bubble_formula("1f1b", 4, 8) == Fraction(3, 11)
    assert bubble_formula("interleaved", 4, 8, 2) == Fraction(3, 19)


def test_simulator_timeline_per_stage_costs_and_p2p():
    s = make_schedule("1f1b", 2, 2)
    r = simulate(s, [1.0, 3.0], [2.0, 6.0], t_p2p=0.5)
    assert [(st, e, str(a)) for st, e, a in r.timeline[1]][:1] == [(1.5, 4.5, "F1.0")]
    assert r.makespan == max(e for row in r.timeline for _, e, _ in row)
    assert 0 < r.bubble_fraction < 1
    with pytest.raises(Stuck, match="rank 0 step 0"):
        bad = Schedule("x", 2, 1, 1, ((Action("B", 0, 0),), (Action("F", 1, 0), Action("B", 1, 0))))
        simulate(bad, 1, 1)


def test_partition_balanced_explicit_and_interleaved():
    assert partition_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert partition_layers(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]  # extra layer to the first
    assert partition_layers(8, 2, boundaries=[3]) == [[0, 1, 2], [3, 4, 5, 6, 7]]
    specs = stage_specs(8, 2, 2)
    assert [(x.stage, x.pp_rank, x.chunk, x.layers, x.first, x.last) for x in specs] == [
        (0, 0, 0, (0, 1), True, False), (1, 1, 0, (2, 3), False, False),
        (2, 0, 1, (4, 5), False, False), (3, 1, 1, (6, 7), False, True)]
    assert [x.stage for x in local_specs(1, 8, 2, 2)] == [1, 3]
    with pytest.raises(ValueError, match="n_layers=8 does not split evenly into pp\\*virtual_"):
        partition_layers(8, 3, 2)
    with pytest.raises(ValueError, match="boundaries=\\[5, 3\\]"):
        partition_layers(8, 3, boundaries=[5, 3])
    with pytest.raises(ValueError, match="6 stages exceeds n_layers=4"):
        partition_layers(4, 3, 2)


def test_plan_problems_name_the_pipeline_values():
    model = ModelConfig(n_layers=8, d_model=32, n_heads=4)
    ok = Plan(pp=4, micro_batches=4, global_batch=8, seq_len=16)
    assert ok.problems(model) == []
    few = "\n".join(ok.replace(micro_batches=2).problems(model))
    assert "micro_batches=2 < pp=4" in few
    inter = "\n".join(ok.replace(schedule="interleaved", virtual_stages=2, micro_batches=9,
                                 global_batch=18).problems(model))
    assert "micro_batches=9 to be a multiple of its rounds max(1, micro_batches // pp=4) = 2" in inter
    assert ok.replace(schedule="interleaved", virtual_stages=2, micro_batches=6,
                      global_batch=12).problems(model) == []  # as PyTorch: rounds of 6
    chunks = "\n".join(Plan(pp=3, schedule="interleaved", virtual_stages=2, micro_batches=3,
                            global_batch=6, seq_len=16).problems(model))
    assert "n_layers=8 does not split evenly into pp*virtual_stages = 6" in chunks
    # the schedule generator refuses the same inputs with the same values named
    assert "micro_batches=2 < pp=4" in schedule_problems("1f1b", 4, 2)[0]
    with pytest.raises(ValueError, match="micro_batches=9 to be a multiple of its rounds"):
        make_schedule("interleaved", 4, 9, 2)
    assert "zbv needs exactly virtual_stages=2" in schedule_problems("zbv", 2, 4, 3)[0]
    assert "zb-h1 needs micro_batches >= pp" in "".join(Plan(pp=4, schedule="zb-h1", micro_batches=2,
                                                               global_batch=8).problems(model))


def _cli(argv):
    from mini3d.run.schedule_cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["schedule"] + argv)
    return args.func(args)


def test_cli_prints_grid_check_and_bubble(capsys):
    assert _cli(["--pp", "4", "--micro-batches", "8", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "rank 3:" in out and "OK: rules hold" in out and "3/11" in out
    assert _cli(["--pp", "2", "--micro-batches", "4", "--schedule", "interleaved",
                 "--virtual-stages", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["check"]["ok"] and data["bubble_fraction"] == pytest.approx(1 / 9)
    assert _cli(["--pp", "4", "--micro-batches", "9", "--schedule", "interleaved"]) == 2
    assert "micro_batches=9 to be a multiple of its rounds" in capsys.readouterr().err
