"""The schedule registry (mini3d/schedule_kinds.py): one object per kind answers every question about
it, and no other module of the package switches on a schedule's name.

The scan walks every module's ast for a comparison (==, !=, in, not in) with a kind name, or a
tuple / list / set of them, and for a dict keyed by kind names. Passing a name to a function
(`make_schedule("1f1b", ...)`) is not a switch. Each answer of the registry is then checked against
the schedule its builder really produces: peaks by `rules.check`, bubbles by the simulator.
"""

from __future__ import annotations

import ast
from fractions import Fraction
from pathlib import Path

import pytest

from mini3d.pp import schedules as sched_mod
from mini3d.pp.rules import check
from mini3d.pp.schedules import make_schedule
from mini3d.pp.schedules import bubble_text
from mini3d.pp.simulator import simulate
from mini3d.schedule_kinds import KINDS, MULTI_CHUNK, SCHEDULES, schedule_kind, schedule_problems

pytestmark = pytest.mark.timeout(120)
PKG = Path(__file__).resolve().parents[1] / "mini3d"
REGISTRY = PKG / "schedule_kinds.py"


def _names(node) -> list[str]:
    """The kind names a node spells: a string constant, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in KINDS:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts for n in _names(e)]
    return []


def schedule_switches(source: str) -> list[str]:
    """'line: name' for every place `source` compares with, or keys a dict by, a schedule's name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            if all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                names = [n for side in [node.left, *node.comparators] for n in _names(side)]
                out += [f"{node.lineno}: {n}" for n in names]
        elif isinstance(node, ast.Dict):
            out += [f"{node.lineno}: {n}" for k in node.keys if k is not None for n in _names(k)]
        elif isinstance(node, ast.MatchValue):
            out += [f"{node.lineno}: {n}" for n in _names(node.value)]
    return out


def test_the_scan_catches_a_switch():
    """It is not a no-op: each form of switching on a name is found, a plain call is not."""
    assert schedule_switches('if plan.schedule == "zbv":\n    pass') == ["1: zbv"]
    assert schedule_switches('x = 2 if kind in ("interleaved", "looped-bfs") else 1') == [
        "1: interleaved", "1: looped-bfs"]
    assert schedule_switches('ok = "gpipe" != kind') == ["1: gpipe"]
    assert schedule_switches('FORMS = {"1f1b": "(p-1)/(m+p-1)", "other": 1}') == ["1: 1f1b"]
    assert schedule_switches('match kind:\n    case "zb-h1":\n        pass') == ["2: zb-h1"]
    assert schedule_switches('s = make_schedule("1f1b", 2, 4)\nif lr == "cosine": pass') == []


def test_no_module_outside_the_registry_switches_on_a_schedule_name():
    found = [f"{p.relative_to(PKG)}:{hit}" for p in sorted(PKG.rglob("*.py")) if p != REGISTRY
             for hit in schedule_switches(p.read_text())]
    assert not found
    assert schedule_switches(REGISTRY.read_text()) == []  # even the registry asks objects


def test_the_names_are_the_registry_s():
    from mini3d.config import SCHEDULES as CONFIG_SCHEDULES
    from mini3d.course.viz.pipeline import SCHEDULE_MENU
    from mini3d.pp.schedules import KINDS as PP_KINDS

    assert SCHEDULES == ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zbv")
    assert CONFIG_SCHEDULES is SCHEDULES and PP_KINDS is SCHEDULES and SCHEDULE_MENU is SCHEDULES
    assert MULTI_CHUNK == ("interleaved", "looped-bfs", "zbv")
    assert sorted(k.builder for k in KINDS.values()) == sorted(sched_mod.BUILDERS)  # one each
    with pytest.raises(ValueError, match="schedule='pipedream' is unknown"):
        schedule_kind("pipedream")
    assert schedule_problems("pipedream", 2, 4) == [
        "schedule='pipedream' is unknown (choose gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zbv)"]


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_kind_names_its_builder_chunks_and_placement(name):
    k = schedule_kind(name)
    assert sched_mod.BUILDERS[k.builder] is getattr(sched_mod, k.builder)
    for v in (1, 2, 3):
        chunks = k.chunks(v)
        if schedule_problems(name, 2, 4, chunks):
            assert name == "interleaved" and chunks == 1  # interleaving needs two chunks or more
            continue
        s = make_schedule(name, 2, 4, chunks)
        assert (s.kind, s.v, s.placement) == (name, chunks, k.placement)
        assert s.split == k.split
    assert k.multi_chunk == (k.chunks(3) > 1) and k.default_v == (2 if k.multi_chunk else 1)


def _stage_peak(s, stage: int) -> int:
    """Most micro-batches alive on `stage` at once (its F done, its last B / W not yet), counted
    on the schedule's compute order."""
    r, end = s.rank_of(stage), "W" if s.split else "B"
    live = peak = 0
    for a in s.compute(r):
        if a.stage == stage:
            live += {"F": 1, end: -1}.get(a.op, 0)
            peak = max(peak, live)
    return peak


GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in range(1, 21)]


@pytest.mark.parametrize("name", SCHEDULES)
def test_in_flight_answers_are_the_schedules_peaks(name):
    """in_flight per rank = check()'s measured peak, head_in_flight = the last stage's, for every
    p up to 8 and m up to 20 the kind accepts (ZB-V's closed form min(2p, 2m, m + r + 1) included)."""
    k, seen = schedule_kind(name), 0
    for p, m in GRID:
        v = k.chunks(2)
        if schedule_problems(name, p, m, v):
            continue
        s = make_schedule(name, p, m, v)
        result = check(s)
        assert result.ok, (name, p, m)
        assert result.peak_in_flight == [k.in_flight(p, m, v, r) for r in range(p)], (name, p, m)
        assert _stage_peak(s, s.n_stages - 1) == k.head_in_flight(p, m), (name, p, m)
        seen += 1
    assert seen >= 60


@pytest.mark.parametrize("name", SCHEDULES)
def test_bubble_answers_are_the_simulated_bubbles(name):
    """The closed form = the simulator's exact bubble at uniform unit costs (per stage 1/v, 2/v);
    a kind without one (ZB-V) says so and the text gives the simulated value."""
    k = schedule_kind(name)
    for p, m in [(2, 4), (4, 4), (4, 8), (3, 9)]:
        v = k.chunks(2)
        sim = simulate(make_schedule(name, p, m, v), Fraction(1, v), Fraction(2, v)).bubble_fraction
        b = k.bubble(p, m, v)
        text = bubble_text(name, p, m, v)
        if k.form is None:
            assert b is None and text.endswith(f"{float(sim):.1%}") and "no closed form" in text
        else:
            assert b == sim, (name, p, m)
            assert text.startswith(f"{k.form} = {b.numerator}/{b.denominator}")


def test_model_problems_belong_to_the_kind():
    import dataclasses

    from mini3d.config import PRESETS, Plan

    tied = dataclasses.replace(PRESETS["tiny"], tie_embeddings=True)
    zbv = Plan(pp=2, schedule="zbv", virtual_stages=2, micro_batches=4, global_batch=4)
    assert any("tied embeddings" in s for s in zbv.problems(tied))
    assert not any("tied embeddings" in s for s in zbv.replace(schedule="zb-h1", virtual_stages=1)
                   .problems(tied))
    assert [k.name for k in KINDS.values() if k.model_problems(2, True)] == ["zbv"]
