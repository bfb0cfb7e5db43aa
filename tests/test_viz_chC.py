"""Figures and explorers of chapters 07-09 (mini3d/course/viz/recompute_tradeoff.py, failures.py,
planning.py): figure data equals the data passed in, and each explorer's controls move its figure in the expected direction."""

from __future__ import annotations

import pytest

from mini3d.config import PRESETS, Plan
from mini3d.cost.activations import layer_activation_bytes
from mini3d.course.viz import failures, planning, recompute_tradeoff

pytestmark = pytest.mark.timeout(120)
MIB = 2**20


def _trace(fig, name):
    found = [t for t in fig.data if t.name == name]
    assert len(found) == 1, [t.name for t in fig.data]
    return found[0]


def _units(fig, axes):
    for a in axes:
        title = getattr(fig.layout, a + "axis").title.text
        assert "(" in title and ")" in title, title


# ----------------------------------------------------------------- 07 recomputation


def test_recompute_rows_follow_estimator_and_flops():
    cfg = PRESETS["gpt-22b"]
    rows = {r["policy"]: r for r in recompute_tradeoff.recompute_rows(cfg, seq_len=2048, micro_batch=4, tp=8)}
    for policy, r in rows.items():
        plan = Plan(tp=8, recompute=policy, dtype="bf16", global_batch=4, seq_len=2048)
        stored = layer_activation_bytes(cfg, plan)
        assert r["layer_bytes"] == stored["stored"]
        extra = stored["full"] if policy == "full" else 0
        assert r["activation_bytes"] == cfg.n_layers * stored["stored"] + extra
    assert rows["none"]["activation_bytes"] > rows["selective"]["activation_bytes"] > rows["full"]["activation_bytes"]
    assert rows["none"]["compute_factor"] == 1.0
    assert 1.0 < rows["selective"]["compute_factor"] < 1.05  # the attention core only: a few percent
    assert rows["full"]["compute_factor"] == pytest.approx(4 / 3, abs=0.01)  # one more forward of 3 units


def test_recompute_explorer_directions():
    box = recompute_tradeoff.recompute_explorer(model="gpt-22b", policy="selective", seq_len=1024, micro_batch=1, tp=1)
    chosen = lambda: box.figure.layout.meta["chosen"]  # noqa: E731
    base = chosen()
    assert base["policy"] == "selective" and "less than none" in box.status.value
    policy_trace = _trace(box.figure, "policy")
    assert list(policy_trace.text) == ["none", "selective", "full"]
    box.controls["seq_len"].value = 4096
    longer = chosen()
    assert longer["activation_bytes"] == pytest.approx(4 * base["activation_bytes"])  # selective: linear in s
    assert longer["compute_factor"] > base["compute_factor"]  # the recomputed core grows with s
    box.controls["tp"].value = 8
    assert chosen()["activation_bytes"] < longer["activation_bytes"]
    box.controls["policy"].value = "full"
    assert chosen()["activation_bytes"] < longer["activation_bytes"] and chosen()["compute_factor"] > 1.3
    box.controls["micro_batch"].value = 8
    assert chosen()["activation_bytes"] == pytest.approx(8 * recompute_tradeoff.recompute_view(
        "gpt-22b", "full", 4096, 1, 8)["chosen"]["activation_bytes"])
    with pytest.raises(ValueError, match="tp=3 does not divide n_heads=64"):
        recompute_tradeoff.recompute_view("gpt-22b", "none", 2048, 1, 3)


def test_measured_vs_estimated_figure_and_ledger():
    acts = {"embed": 10, "layer0.ln1": 100, "layer0.attn": 300, "layer1.attn": 7, "layer0.block": 5}
    assert recompute_tradeoff.layer_ledger_bytes(acts, 0) == 405 and recompute_tradeoff.layer_ledger_bytes(acts, 1) == 7
    rows = [dict(policy="none", measured_bytes=3 * MIB, estimated_bytes=2.5 * MIB, compute_factor=1.0,
                 measured_time_factor=1.0),
            dict(policy="full", measured_bytes=0.5 * MIB, estimated_bytes=0.5 * MIB, compute_factor=1.33)]
    fig = recompute_tradeoff.measured_vs_estimated_figure(rows)
    assert list(_trace(fig, "measured (live ledger)").y) == [3.0, 0.5]
    assert list(_trace(fig, "estimated").y) == [2.5, 0.5]
    labels = list(_trace(fig, "estimated").x)
    assert "x1.00 measured" in labels[0] and "x1.33 est." in labels[1] and "measured" not in labels[1]
    _units(fig, "y")


# ----------------------------------------------------------------- 08 debugging


def _event(rank, op, seq, start, end, axis="dp", age=None):
    return dict(rank=rank, axis=axis, op=op, seq=seq, start=start, end=end, age_s=age)


def test_hang_timeline_marks_pending_ops_and_missing_ranks():
    dumps = {0: {"coords": {"tp": 0, "pp": 0, "dp": 0},
                 "events": [_event(0, "all_reduce", 1, 10.0, 10.5), _event(0, "all_reduce", 2, 11.0, None, age=3.0)]},
             2: {"coords": {"tp": 0, "pp": 0, "dp": 2}, "events": [_event(2, "all_reduce", 1, 10.2, 10.5)]}}
    fig = failures.hang_timeline_figure(dumps, world=3)
    assert fig.layout.meta["pending"] == [[0, "all_reduce", "dp", 2]] or \
        fig.layout.meta["pending"] == [(0, "all_reduce", "dp", 2)]
    done, pending = _trace(fig, "dp completed"), _trace(fig, "dp PENDING")
    assert list(done.base) == pytest.approx([0.0, 0.2]) and list(done.x) == pytest.approx([0.5, 0.3])
    assert list(pending.base) == pytest.approx([1.0]) and list(pending.x) == pytest.approx([3.0])
    missing = _trace(fig, "rank 1: no ops logged")
    assert "no dump" in missing.y[0]
    _units(fig, "x")


def test_load_dumps_and_oom_figure(tmp_path):
    import json

    (tmp_path / "rank1.json").write_text(json.dumps({"events": []}))
    (tmp_path / "rank0.json").write_text(json.dumps({"events": [1]}))
    (tmp_path / "launcher.json").write_text("{}")
    assert list(failures.load_dumps(str(tmp_path))) == [0, 1]
    oom = {"category": "activations", "requested": 2 * MIB, "budget": 4 * MIB,
           "measured": {"params": MIB, "grads": MIB, "optimizer": 2 * MIB},
           "estimated": {"params": MIB, "grads": MIB, "optimizer": 2 * MIB, "activations": 10 * MIB}}
    fig = failures.oom_figure(oom)
    assert list(_trace(fig, "activations").y) == [2.0, 10.0]  # the request, then the estimate
    assert list(_trace(fig, "optimizer state").y) == [2.0, 2.0]
    assert fig.layout.shapes[0].y0 == 4.0  # the budget line, MiB
    _units(fig, "y")


# ----------------------------------------------------------------- 09 planning


def fake_plan_fn(model="m", hardware="A", gpus=8, global_batch=32):
    """Two layouts per query; step time falls with gpus; memory falls with tp; capacity 80 GiB."""
    rows = [dict(tp=t, pp=1, dp=gpus // t, layout=f"tp{t}", step_time_s=global_batch / gpus * (1 + t / 10),
                 memory_bytes=160 * 2**30 / t, fits=160 / t <= 80,
                 breakdown={k: (global_batch / gpus) / 6 for k in planning.TIME_TERMS}) for t in (1, 2, 4)]
    ranked = sorted((r for r in rows if r["fits"]), key=lambda r: r["step_time_s"])
    return dict(rows=rows, ranked=ranked, capacity_bytes=80 * 2**30, explanation=f"best {ranked[0]['layout']}")


def test_plan_explorer_directions():
    box = planning.plan_explorer(fake_plan_fn, models=("m",), model="m", hardware=("A", "B"), gpus=8,
                             global_batch=32)
    scatter, bars = box.figures
    best = scatter.layout.meta["best"]
    assert best["layout"] == "tp2" and "best tp2" in box.status.value
    assert [t.name for t in scatter.data] == ["fits", "does not fit"]
    assert list(scatter.data[1].text) == [""]  # only the best layout is labelled on the plot
    assert [t for t in scatter.data[0].text if t] == ["best: tp2 pp1 dp4"] and scatter.data[0].textposition == "top right"
    t8 = best["step_time_s"]
    box.controls["gpus"].value = 32
    t32 = scatter.layout.meta["best"]["step_time_s"]
    assert t32 < t8  # more GPUs, shorter step
    box.controls["global_batch"].value = 128
    assert scatter.layout.meta["best"]["step_time_s"] > t32  # a bigger batch, a longer step
    assert len(bars.data) == len(planning.TIME_TERMS) and list(bars.data[0].y)[0].startswith("1. tp2")
    _units(scatter, "xy")
    _units(bars, "x")


def test_time_breakdown_bars_add_up_to_the_step_time_with_cp():
    """Chapter 09 draws "the same numbers" as its list: each layout's stacked bar must reach its step
    time, a cp > 1 layout included (its ring was once left out of the stack, drawing 4 s short)."""
    from mini3d.config import PRESETS, Plan
    from mini3d.cost.hardware import PRESETS as GPUS
    from mini3d.cost.model import estimate_cost

    for plan in (Plan(tp=2, cp=4, dp=4, zero=3, global_batch=32, seq_len=4096, dtype="bf16",
                      sequence_parallel=True),
                 Plan(tp=4, pp=4, dp=2, global_batch=32, micro_batches=8, seq_len=4096, dtype="bf16")):
        est = estimate_cost(PRESETS["llama-3.1-70b"], plan, GPUS["A100-80GB"])
        fig = planning.time_breakdown_figure([planning._row(est, "x")])
        drawn = sum(t.x[0] for t in fig.data)
        assert drawn == pytest.approx(est.step_time_s, rel=1e-9), (plan, drawn, est.step_time_s)


def test_planner_fn_real_search_ranks_and_covers_layouts():
    view = planning.plan_view(planning.planner_fn(), model="gpt-1.3b", hardware="A100-40GB", gpus=4, global_batch=8)
    times = [r["step_time_s"] for r in view["ranked"]]
    assert times == sorted(times) and all(r["fits"] for r in view["ranked"])
    layouts = {(r["tp"], r["pp"], r["dp"]) for r in view["rows"]}
    assert len(layouts) == len(view["rows"]) and (1, 1, 4) in layouts and (4, 1, 1) in layouts
    best_row = min((r for r in view["rows"] if r["fits"]), key=lambda r: r["step_time_s"])
    assert best_row["step_time_s"] == pytest.approx(view["best"]["step_time_s"])
    assert view["explanation"].startswith("best:")
    # the adapter for the shared planner_explorer: less memory per GPU, fewer layouts fit
    fn = planning.planner_explorer_fn(hardware="A100-80GB", global_batch=8)
    fit80 = sum(r["fits"] for r in fn(model="gpt-1.3b", gpus=4, gpu_mem_gib=80))
    fit24 = sum(r["fits"] for r in fn(model="gpt-1.3b", gpus=4, gpu_mem_gib=24))
    assert fit24 <= fit80 and fit80 >= 1


def test_predicted_vs_measured_and_scaling():
    rows = [dict(layout="a", predicted_s=0.1, measured_s=0.2, measured_min_s=0.15, measured_max_s=0.3)]
    fig = planning.predicted_vs_measured_figure(rows)
    assert list(_trace(fig, "predicted (cost model)").y) == [0.1]
    meas = _trace(fig, "measured (median, min-max)")
    assert list(meas.y) == [0.2] and list(meas.error_y.array) == pytest.approx([0.1])
    assert list(meas.error_y.arrayminus) == pytest.approx([0.05])
    _units(fig, "y")
    sc = planning.scaling_rows("gpt-175b", "A100-80GB", tp=8, pp=8, global_batch=256, gpus=(64, 256, 1024))
    eff = [r["efficiency"] for r in sc]
    assert eff[0] == 1.0 and eff[0] > eff[1] > eff[2]  # the communication / bubble tax grows with dp
    assert sc[0]["bubble_fraction"] < sc[-1]["bubble_fraction"]


def test_pending_labels_sit_outside_the_hatching_and_oom_advice_fits_the_category():
    """Chapter 08's prediction reads the pending ops' labels: outside the hatched bar, inside the
    x range; the OOM report's advice names what lowers the failing category (ZeRO for the optimizer
    state, not the activations' remedies)."""
    from mini3d.diagnose.faults import oom_report

    dumps = {0: {"coords": {"pp": 0}, "events": [_event(0, "send", 1, 0.0, 1.0, "pp"),
                                                 _event(0, "recv", 2, 1.0, None, "pp", age=4.0)]}}
    fig = failures.hang_timeline_figure(dumps)
    assert _trace(fig, "pp PENDING").textposition == "outside" and _trace(fig, "pp completed").textposition == "inside"
    assert fig.layout.xaxis.range[1] > 5.0
    args = dict(rank=0, coords={"dp": 0}, measured={"optimizer": 3 * MIB}, estimated=None, budget=MIB, requested=0)
    opt, act = oom_report(category="optimizer", **args), oom_report(category="activations", **args)
    assert "ZeRO" in opt.splitlines()[-1] and "recompute" not in opt.splitlines()[-1]
    assert "recompute" in act.splitlines()[-1]
