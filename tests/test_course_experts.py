"""Chapter 10's numbers (mini3d.course.experts) and its figures and explorer
(mini3d.course.viz.experts), checked against counts made here from the engine's own pieces.

The live runs themselves are the chapter's (nbmake); here only the command line they use is
checked, through its refusal path: a bad split exits 2 before any process starts, and the helper
reports it."""

from __future__ import annotations

import dataclasses

import pytest

from mini3d.config import PRESETS
from mini3d.course import experts as X

MIXTRAL = PRESETS["mixtral-8x7b"]


def test_capacity_rows_drop_what_the_capacity_rule_drops():
    rows = X.capacity_rows(factors=(0.0, 0.75, 1.0, 2.0), tokens=128, skew=0.5)
    picked = rows[0]["selected"]
    assert sum(picked) == 128 * 2 and rows[0]["dropped"] == 0 and rows[0]["capacity"] == 0
    for r in rows[1:]:
        assert r["selected"] == picked  # same weights, same batch: the same choices
        assert r["dropped"] == sum(n - min(n, r["capacity"]) for n in picked)
    assert rows[1]["dropped"] > rows[2]["dropped"] > 0  # a mildly skewed router overflows at C=1
    assert X.balanced_kept(dataclasses.replace(X.capacity_cfg(), capacity_factor=0.5), 128) == 0.5
    assert X.balanced_kept(dataclasses.replace(X.capacity_cfg(), capacity_factor=1.25), 128) == 1.0


def test_a2a_rows_and_ep_vs_tp():
    rows = {(r["top_k"], r["ep"]): r for r in X.a2a_rows(MIXTRAL, eps=(1, 2, 8), top_ks=(1, 2))}
    assert rows[(2, 1)]["step"] == 0 and rows[(2, 8)]["one"] == 2 * rows[(1, 8)]["one"]
    assert rows[(2, 8)]["step"] == 4 * X.moe_layer_count(MIXTRAL) * rows[(2, 8)]["one"]
    cmp = X.ep_vs_tp(MIXTRAL, gpus=8)
    experts = X.expert_params(MIXTRAL)
    assert experts == 32 * 8 * 3 * 4096 * 14336  # 32 layers of 8 SwiGLU experts
    # ep=8: every dense weight, one eighth of the experts
    assert cmp["ep"]["params"] == pytest.approx(MIXTRAL.n_params() - experts * 7 / 8, rel=1e-9)
    # tp=8: an eighth of the dense weights, every routed expert whole (mini3d's tp, expert-tp 1)
    assert cmp["tp"]["params"] == pytest.approx((MIXTRAL.n_params() - experts) / 8 + experts,
                                                rel=0.02)
    assert cmp["ep"]["sent"] == 4 * 32 * 4096 * 2 * 7 / 8 * 4096 * 2  # the balanced a2a, bf16 rows
    assert cmp["tp"]["grad_sync"] == 0 < cmp["ep"]["grad_sync"] and cmp["tp"]["sent"] > cmp["ep"]["sent"]


def test_why_experts_counts_the_active_parameters():
    w = X.why_experts(MIXTRAL, PRESETS["llama-3.1-70b"])
    m, d = w["mixtral-8x7b"], w["llama-3.1-70b"]
    assert d["params"] == d["active_params"] and m["active_params"] < m["params"]
    assert m["fwd_flops_per_token"] == 2 * m["active_params"]


def test_explorer_draws_and_refuses_what_does_not_divide():
    from mini3d.course.viz.experts import moe_explorer, moe_view

    box = moe_explorer(PRESETS["qwen3-30b-a3b"], ep=8)
    assert "mini3d-explorer" in box._dom_classes and len(box.figure.data) == 3  # top_k=8, top_k=1, chosen
    assert "holds 16 of 128 experts" in box.status.value
    before = box.figure.data[-1].y
    box.controls["ep"].value = 128
    assert box.figure.data[-1].y != before and "holds 1 of 128" in box.status.value
    box.controls["capacity_factor"].value = 0.5
    assert "50% of the token-slots kept" in box.status.value
    with pytest.raises(ValueError, match="does not divide"):
        moe_view(MIXTRAL, 3, 2, 0.0)


@pytest.mark.timeout(120)
def test_routing_run_failure_is_reported():
    with pytest.raises(RuntimeError, match=r"exit 2\)[\s\S]*ep=2 does not divide n_experts=3"):
        X.routing_runs((0.0,), experts=3, top_k=1, steps=1)


def test_kv_cache_rows_and_figure_follow_the_one_count():
    """DeepSeek-V3 at 4,096 tokens in bf16: the rows are mini3d.cost.kv_cache's count (61 layers x
    576 numbers x 2 bytes per token for the latent), the bars draw their GiB on a log axis."""
    from mini3d.course.viz.experts import kv_cache_figure

    v3 = PRESETS["deepseek-v3"]
    rows = {r["kind"]: r for r in X.kv_cache_rows(v3, 4096)}
    assert rows["mla"]["per_token"] == 61 * 576 * 2 and rows["mla"]["sequence"] == 4096 * 61 * 576 * 2
    assert rows["full"]["per_layer"] == 128 * (192 + 128) and rows["gqa"]["per_layer"] == 8 * (192 + 128)
    fig = kv_cache_figure(list(rows.values()), 4096, v3.name)
    assert fig.layout.yaxis.type == "log" and list(fig.data[0].y) == [r["sequence"] / 2**30 for r in rows.values()]


def test_routing_reach_bounds_the_nodes_and_counts_rows_per_node():
    reach = X.routing_reach(PRESETS["deepseek-v3"])
    slot, free, limited = reach["every slot"], reach["per node"], reach["per node, limited"]
    assert slot["rows"] == 8 * 7 / 8 and free["nodes"] == slot["nodes"] > limited["nodes"]
    assert limited["max"] == 4 and slot["rows"] > free["rows"] > limited["rows"]
    assert limited["bytes"] / slot["bytes"] == pytest.approx(limited["rows"] / 7)
