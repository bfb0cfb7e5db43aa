"""Figures and explorers of chapters 04-06 (mini3d.course.viz.tp_layer / pipeline_measured /
grid_links), without a browser: figure data equals what mini3d computes, and every explorer control
moves its figure the expected way."""

from __future__ import annotations

import pytest

from mini3d.config import PRESETS, ModelConfig
from mini3d.cost.hardware import PRESETS as HW
from mini3d.grid import Grid
from mini3d.pp import make_schedule, simulate
from mini3d.tp import shard_map
from mini3d.course.viz import grid_links, pipeline_measured, tp_layer

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------- chapter 04


def test_shard_picture_follows_apply_tp_index_ranges():
    cfg = ModelConfig(2, 64, 4, 256, 64)
    fig = tp_layer.shard_map_figure(shard_map(cfg, 2), 2, cells=24)
    owners = fig.layout.meta["owners"]
    # Fused QKV (192 outputs, column-parallel by heads): q, k and v each give rank 0 their first half
    # of the heads, so along the output features the owners go 0,1 | 0,1 | 0,1 in blocks of 32.
    qkv = owners["blocks.*.attn.qkv.weight"]
    assert qkv[0] == ([0] * 4 + [1] * 4) * 3
    assert all(row == qkv[0] for row in qkv)  # every input row alike: the split is on the columns
    # Row-parallel projections split the input features (picture rows), top half on rank 0.
    proj = owners["blocks.*.mlp.proj.weight"]
    assert [row[0] for row in proj] == [0] * 12 + [1] * 12 and all(len(set(r)) == 1 for r in proj)
    # Embedding drawn as stored: vocabulary rows split in two.
    emb = owners["embed.wte.weight"]
    assert [row[0] for row in emb] == [0] * 12 + [1] * 12
    for i in range(len(fig.data)):  # every panel's axes are titled with their unit
        ax = fig.layout["xaxis" + (str(i + 1) if i else "")]
        assert "(" in ax.title.text


def test_tp_event_counts_groups_one_step():
    ev = [dict(axis="tp", op="all_reduce", shape=(2, 8, 4), bytes=256, context={"step": 0})] * 3
    ev += [dict(axis="tp", op="all_reduce", shape=(2, 8), bytes=64, context={"step": 0}),
           dict(axis="tp", op="all_reduce", shape=(2, 8, 4), bytes=256, context={"step": 1}),
           dict(axis="dp", op="all_reduce", shape=(10,), bytes=40, context={"step": 0})]
    rows = tp_layer.tp_event_counts(ev, step=0)
    assert rows == [dict(op="all_reduce", shape=(2, 8, 4), bytes=256, count=3),
                    dict(op="all_reduce", shape=(2, 8), bytes=64, count=1)]


def test_tp_layer_times_and_link_figure():
    rows = tp_layer.tp_layer_times(PRESETS["gpt-7b"], HW["A100-80GB"], (1, 2, 8), seq_len=2048)
    by = {r["tp"]: r for r in rows}
    assert by[1]["comm_nvlink_s"] == 0 and by[1]["ops"] == 0
    assert by[2]["ops"] == 4  # 2 all-reduces forward + 2 backward per layer
    # payload P = 1 * 2048 * 4096 * 2 bytes; ring wire 2 (t-1)/t P per op, 4 ops
    assert by[2]["wire_bytes"] == 4 * 2048 * 4096 * 2
    assert by[8]["comm_internode_s"] > by[8]["comm_nvlink_s"] * 10  # 25 GB/s vs 300 GB/s
    assert by[8]["compute_s"] < by[2]["compute_s"] < by[1]["compute_s"]
    fig = tp_layer.tp_link_figure(rows)
    assert [t.name for t in fig.data] == ["compute", "tp communication"]
    assert list(fig.data[0].x)[:3] == ["tp=1<br>one GPU", "tp=2<br>NVLink", "tp=2<br>across nodes"]
    assert fig.data[1].y[2] == pytest.approx(1e3 * by[2]["comm_internode_s"])
    assert "(ms)" in fig.layout.yaxis.title.text


def test_tp_link_explorer_directions():
    w = tp_layer.tp_link_explorer(model="gpt2-small", hardware="A100-80GB", seq_len=1024)
    tot = lambda: dict(w.figure.layout.meta["totals_ms"])  # noqa: E731
    a = tot()
    assert a["tp=2 across nodes"] > a["tp=1 one GPU"] > a["tp=2 NVLink"]  # the chapter's tale
    assert "slower" in w.status.value
    w.controls["hardware"].value = "H100-80GB"  # faster GPUs and twice the inter-node bandwidth
    b = tot()
    assert b["tp=1 one GPU"] < a["tp=1 one GPU"]
    comm = lambda d: d["tp=2 across nodes"] - d["tp=2 NVLink"]  # noqa: E731
    w.controls["hardware"].value = "A100-80GB"
    w.controls["model"].value = "llama-3.1-70b"  # wider layers: compute grows faster than the all-reduces
    c = tot()
    assert c["tp=2 across nodes"] < c["tp=1 one GPU"] and "faster" in w.status.value
    assert comm(c) > comm(a)
    w.controls["seq_len"].value = 4096
    assert tot()["tp=1 one GPU"] > c["tp=1 one GPU"]


# ----------------------------------------------------------------- chapter 05


def _fake_results(kind="1f1b", p=2, m=4, t_f=2.0, t_b=3.0, t0=100.0):
    """Per-rank results whose timelines are a simulation (in seconds, offset by t0), plus tp=1
    replicas that must be ignored."""
    sim = simulate(make_schedule(kind, p, m), t_f, t_b)
    out = []
    for r, row in enumerate(sim.timeline):
        tl = [(t0 + s, t0 + e, str(a)) for s, e, a in row]
        out.append(dict(coords={"tp": 0, "pp": r, "dp": 0}, timeline=tl))
        out.append(dict(coords={"tp": 1, "pp": r, "dp": 0}, timeline=[(0.0, 99.0, "F0.0")]))
    return out, sim


def test_measured_vs_simulated_recovers_the_simulation():
    res, sim = _fake_results()
    tl = pipeline_measured.measured_timeline(res)
    assert len(tl) == 2 and tl[0][0][:2] == (0.0, 2000.0)  # ms from the first action
    t_f, t_b = pipeline_measured.stage_costs(tl, 2)
    assert t_f == pytest.approx([2000.0, 2000.0]) and t_b == pytest.approx([3000.0, 3000.0])
    cmp = pipeline_measured.measured_vs_simulated(res, "1f1b", 2, 4)
    assert cmp["simulated_bubble"] == pytest.approx(float(sim.bubble_fraction))
    assert cmp["measured_bubble"] == pytest.approx(float(sim.bubble_fraction))
    assert cmp["measured_makespan"] == pytest.approx(1e3 * float(sim.makespan))
    with pytest.raises(ValueError, match="timeline"):
        pipeline_measured.measured_timeline([dict(coords={"tp": 0, "pp": 0, "dp": 0})])


def test_measured_bubble_counts_transfers_as_idle():
    res, sim = _fake_results()
    for r in res:  # a slow receive before each backward shows up as idle time
        r["timeline"] = [(s + 0.5 * i, e + 0.5 * i, a) for i, (s, e, a) in enumerate(r["timeline"])]
    cmp = pipeline_measured.measured_vs_simulated(res, "1f1b", 2, 4)
    assert cmp["measured_bubble"] > cmp["simulated_bubble"]


# ----------------------------------------------------------------- chapter 06


def test_link_table_8_ranks_on_two_nodes():
    rows = {r["axis"]: r for r in grid_links.link_table(Grid(2, 2, 2), 4)}
    assert rows["tp"]["crossing"] == 0 and rows["tp"]["link"].startswith("NVLink")
    assert rows["pp"]["crossing"] == 4 and rows["pp"]["link"].startswith("InfiniBand")
    assert rows["dp"]["groups"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    bad = {r["axis"]: r for r in grid_links.link_table(Grid(2, 2, 2, order="pp-dp-tp"), 4)}
    assert bad["tp"]["crossing"] == 4  # tp slowest: every tp group spans both nodes
    assert "<table>" in grid_links.link_table_html(list(rows.values()))


def test_rank_grid_explorer_directions():
    w = grid_links.rank_grid_explorer(tp=2, pp=2, dp=2, color_by="tp", gpus_per_node=4)
    names = lambda: [t.name for t in w.figure.data]  # noqa: E731
    assert names().count("node 0") == 1 and "node 1" in names()
    assert sum(n.startswith("tp group") for n in names()) == 4
    w.controls["color_by"].value = "pp"
    assert sum(n.startswith("pp group") for n in names()) == 4
    w.controls["gpus_per_node"].value = 8  # one node holds everything
    assert "node 1" not in names()
    w.controls["dp"].value = 4  # 16 ranks now: two nodes again, more pp groups
    assert "node 1" in names() and sum(n.startswith("pp group") for n in names()) == 8
    assert "InfiniBand" in w.status.value  # pp groups now cross nodes
    w.controls["gpus_per_node"].value = 1  # every rank its own node: tp leaves NVLink
    assert w.status.value.count("InfiniBand") == 3


def test_gantt_panels_one_panel_per_schedule():
    sims = {k: simulate(make_schedule(k, 4, 8, v), 1.0 / v, 2.0 / v).timeline
            for k, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))}
    fig = pipeline_measured.gantt_panels(sims)
    b = fig.layout.meta["bubbles"]
    assert b["gpipe"] == pytest.approx(3 / 11) and b["1f1b"] == pytest.approx(3 / 11)
    assert b["interleaved"] == pytest.approx(3 / 19)
    fwd = [t for t in fig.data if t.name == "forward"]
    assert len(fwd) == 3 and [len(t.x) for t in fwd] == [32, 32, 32]  # p*m forwards of chunk 0
    # interleaving's second chunk is its own trace, in its own shade (one colour per chunk)
    (chunk1,) = [t for t in fig.data if t.name == "forward chunk 1"]
    assert len(chunk1.x) == 32 and chunk1.marker.color != fwd[2].marker.color
    assert sum(t.showlegend for t in fig.data) == len({t.name for t in fig.data})  # one legend entry each
    assert "(" in fig.layout.xaxis3.title.text
