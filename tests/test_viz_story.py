"""Chapter 08's budget explorer and the 70B scenario figures (the data behind them)."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from mini3d.config import PRESETS  # noqa: E402
from mini3d.course.viz import oom_explorer as oe  # noqa: E402


def test_budget_view_reports_the_oom_of_the_chapter_run_and_its_fixes():
    tiny = PRESETS["tiny"]
    v = oe.budget_view(tiny, budget_mib=4)  # the chapter's run: pp=1, one micro-batch, 4 MiB
    assert v["oom"] is not None and v["oom"].category == "activations"
    assert "OUT OF MEMORY on rank 0" in v["oom"].report
    # the predict question's answer: with pp=1 the model states stay whole, nothing fits 4 MiB
    assert all(oe.budget_view(tiny, 4, 1, m, r)["oom"] is not None
               for m in (1, 2, 4, 8) for r in ("none", "selective", "full"))
    assert oe.budget_view(tiny, 4, pp=2, micro_batches=8)["oom"] is None
    assert oe.budget_view(tiny, budget_mib=32)["oom"] is None
    with pytest.raises(ValueError, match="micro_batches"):
        oe.budget_view(tiny, 4, pp=2, micro_batches=1)


def test_oom_explorer_moves_between_report_and_fit():
    box = oe.oom_explorer(PRESETS["tiny"])
    assert "exit status 4" in box.status.value and "largest" in box.status.value
    before = [list(t.y) for t in box.figure.data if t.y is not None]
    box.controls["budget_mib"].value = 32
    assert box.status.value.startswith("fits")
    box.controls["pp"].value = 2  # one micro-batch for two stages: refused, named in the status
    assert "micro_batches" in box.status.value
    box.controls["micro_batches"].value = 8
    after = [list(t.y) for t in box.figure.data if t.y is not None]
    assert after != before and len(box.figure._widget_data) == len(box.figure.data)


def test_story_rows_follow_each_chapters_technique():
    from mini3d.course.viz import story70b as s

    rows = {r["label"]: r for r in s.story_rows({
        "zero0": dict(dp=8), "zero3": dict(dp=8, zero=3), "tp8": dict(tp=8, zero=1),
        "pp2": dict(tp=8, pp=2, zero=1), "none": dict(tp=8, pp=2, dp=2, zero=1),
        "full": dict(tp=8, pp=2, dp=2, zero=1, recompute="full")})}
    assert rows["zero3"]["memory"]["optimizer"] < rows["zero0"]["memory"]["optimizer"] / 4
    assert rows["zero3"]["memory"]["params"] < rows["zero0"]["memory"]["params"]
    assert rows["zero0"]["time"]["bubble"] == 0 < rows["pp2"]["time"]["bubble"]
    assert rows["tp8"]["time"]["tp_comm"] > 0 == rows["zero0"]["time"]["tp_comm"]
    assert rows["full"]["memory"]["activations"] < rows["none"]["memory"]["activations"]
    assert rows["full"]["time"]["compute"] > rows["none"]["time"]["compute"]  # the price of recompute
    for r in rows.values():  # the terms are the whole step, as the cost model adds it up
        assert abs(sum(r["time"].values()) - r["step_time_s"]) < 1e-9 * r["step_time_s"]
    assert rows["zero0"]["gpus"] == 8 and rows["none"]["gpus"] == 32 and not rows["zero0"]["fits"]
    assert "does NOT fit" in s.story_lines([rows["zero0"]])


def test_story_figure_has_both_panels_and_the_capacity():
    from mini3d.course.viz import story70b as s

    fig = s.story_figure(s.story_rows({"a": dict(dp=8), "b": dict(tp=8, pp=2)}))
    axes = {(t.xaxis or "x") for t in fig.data if t.type == "bar"}
    assert axes == {"x", "x2"}  # memory on the left, time on the right
    names = {t.name for t in fig.data}
    assert {"optimizer state", "pipeline bubble", "GPU capacity 80 GiB"} <= names
    assert [r["label"] for r in fig.layout.meta["rows"]] == ["a", "b"]


def test_predict_reveals_the_computed_answer_and_judges_the_pick():
    from mini3d.course.viz.predict import predict

    box = predict("How many?", [7, 14, 28], 28, why="because")
    box.reveal()
    assert "<b>28</b> (no guess" in box.shown.value and "because" in box.shown.value
    box.pick.value = 14
    box.reveal()
    assert "not quite" in box.shown.value
    box.pick.value = 28
    box.reveal()
    assert "(right" in box.shown.value
    with pytest.raises(ValueError, match="not among"):
        predict("?", ["a", "b"], "c")


def test_every_step_time_term_of_the_cost_model_is_charted():
    """The charts stack the cost model's own terms (mini3d.cost.model.TIME_TERMS, one list): they
    are the breakdown's whole step (its other entries the listed details), each has a label and a
    colour, and with ep > 1 the all-to-alls are drawn as "ep all-to-all" in the story's panel and
    the planner's bars."""
    from mini3d.cost.model import BREAKDOWN_DETAILS, TIME_TERMS
    from mini3d.course.viz import planning, story70b as s

    rows = s.story_rows({"ep": dict(tp=2, dp=4, ep=4, zero=1), "dense": dict(tp=2, dp=4, zero=1)},
                        model="mixtral-8x7b")
    assert rows[0]["time"]["ep_comm"] > 0 == rows[1]["time"]["ep_comm"]
    for r in rows:
        assert abs(sum(r["time"].values()) - r["step_time_s"]) < 1e-9 * r["step_time_s"]
    from mini3d.config import model_from_preset
    from mini3d.cost.hardware import load_hardware
    from mini3d.cost.model import estimate_cost

    est = estimate_cost(model_from_preset("mixtral-8x7b"), rows[0]["plan"], load_hardware("A100-80GB"))
    assert set(est.breakdown) - set(BREAKDOWN_DETAILS) == set(TIME_TERMS)
    assert s.TIME_TERMS is planning.TIME_TERMS is TIME_TERMS
    assert set(TIME_TERMS) <= set(planning.TERM_LABELS) & set(planning.TERM_COLORS)
    names = {t.name for t in s.story_figure(rows).data}
    assert "ep all-to-all" in names
    ranked = [dict(layout="tp2 dp4 ep4", breakdown=rows[0]["time"])]
    assert "ep all-to-all" in {t.name for t in planning.time_breakdown_figure(ranked).data}
