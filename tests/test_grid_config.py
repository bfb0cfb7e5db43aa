import itertools

import pytest

from mini3d.config import PRESETS, ModelConfig, Plan
from mini3d.grid import Grid


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (4, 2, 1), (1, 4, 2), (2, 1, 4), (1, 1, 1), (3, 2, 2)])
@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-pp-dp", "pp-dp-tp", "dp-tp-pp"])
def test_each_rank_in_exactly_one_group_per_axis(tp, pp, dp, order):
    g = Grid(tp, pp, dp, order)
    world = tp * pp * dp
    for axis, size in (("tp", tp), ("pp", pp), ("dp", dp), ("mp", tp * pp)):
        groups = g.groups(axis)
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(world)), (axis, groups)
        assert all(len(grp) == size for grp in groups)
    for r in range(world):
        c = g.coords(r)
        assert g.rank_of(**c) == r
        # members of my tp group differ from me only in the tp coordinate, ordered by it
        for axis in ("tp", "pp", "dp"):
            grp = g.group_of(r, axis)
            assert [g.coords(x)[axis] for x in grp] == list(range(g.sizes[axis]))
            assert all({k: v for k, v in g.coords(x).items() if k != axis} ==
                       {k: v for k, v in c.items() if k != axis} for x in grp)
    # the fastest axis in the order is the one whose coordinate changes between rank 0 and rank 1
    fastest = order.split("-")[0]
    if g.sizes[fastest] > 1:
        assert g.coords(1)[fastest] == 1


def test_worked_example_of_the_docstring():
    g = Grid(2, 2, 2)
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.groups("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g.groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    import mini3d.grid as mod

    for line in ("tp groups        [0, 1] [2, 3] [4, 5] [6, 7]", "dp groups        [0, 2] [1, 3] [4, 6] [5, 7]",
                 "pp groups        [0, 4] [1, 5] [2, 6] [3, 7]", "mp groups        [0, 1, 4, 5] [2, 3, 6, 7]"):
        assert line in mod.__doc__


def test_describe_flags_tp_groups_crossing_nodes():
    assert "stays inside one node" in Grid(2, 2, 2).describe(gpus_per_node=4)
    text = Grid(4, 1, 2).describe(gpus_per_node=2)
    assert "WARNING" in text and "[0, 1, 2, 3]" in text
    # tp slowest: tp groups are strided and cross nodes
    assert Grid(2, 1, 4, order="dp-pp-tp").crossing_groups("tp", 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_plan_problems_name_each_value():
    cfg = PRESETS["tiny"]
    assert Plan().problems(cfg) == []
    p = Plan(tp=3, pp=8, dp=1, global_batch=7, micro_batches=2).problems(cfg, world_size=8)
    text = " | ".join(p)
    for needle in ("world size 8 != tp*pp*dp = 3*8*1 = 24", "tp=3 does not divide n_heads=4",
                   "pp=8 x virtual_stages=1 = 8 stages exceeds n_layers=4", "global_batch=7",
                   "1f1b needs micro_batches >= pp"):
        assert needle in text
    assert any("zero=5" in s for s in Plan(zero=5).problems(cfg))
    assert any("interleaved needs micro_batches=9 to be a multiple of its rounds" in s
               for s in Plan(pp=4, schedule="interleaved", virtual_stages=2, micro_batches=9,
                             global_batch=18).problems(ModelConfig(n_layers=8)))
    assert any("n_layers=6 does not split evenly" in s
               for s in Plan(pp=2, schedule="interleaved", virtual_stages=2, micro_batches=2,
                             global_batch=4).problems(ModelConfig(n_layers=6)))
    assert any("n_heads=3 does not divide d_model=64" in s for s in Plan().problems(ModelConfig(n_heads=3)))


def test_n_params_matches_the_model():
    from mini3d.models.transformer import GPT

    for cfg in (PRESETS["tiny"], ModelConfig(n_layers=3, d_model=48, n_heads=6, vocab_size=300, d_ff=100)):
        assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.n_params()
    assert 69e9 < PRESETS["gpt-70b"].n_params() < 71e9


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-dp-cp-pp", "cp-tp-pp-dp"])
def test_cp_axis_groups_and_the_combined_gradient_group(order):
    g = Grid(2, 2, 2, order, cp=2)  # 16 ranks
    assert g.world_size == 16
    for r in range(16):
        c = g.coords(r)
        assert g.rank_of(**c) == r
        grp = g.group_of(r, "cp")
        assert [g.coords(x)["cp"] for x in grp] == [0, 1]
        assert all({k: v for k, v in g.coords(x).items() if k != "cp"} ==
                   {k: v for k, v in c.items() if k != "cp"} for x in grp)
        both = g.group_of(r, "dp_cp")  # same tp and pp coordinates: the same weights
        assert len(both) == 4 and {(g.coords(x)["tp"], g.coords(x)["pp"]) for x in both} == \
            {(c["tp"], c["pp"])}
        assert set(g.group_of(r, "cp")) | set(g.group_of(r, "dp")) <= set(both)
    fastest, second = order.split("-")[:2]
    assert g.coords(1)[fastest] == 1 and g.coords(2)[second] == 1


def test_cp_worked_example_and_three_axis_orders():
    g = Grid(2, 2, 1, cp=2)  # tp=2, cp=2, pp=2, default order tp-cp-dp-pp
    assert g.order == ("tp", "cp", "dp", "pp")
    assert g.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("dp_cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("mp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    import mini3d.grid as mod

    for line in ("cp groups        [0, 2] [1, 3] [4, 6] [5, 7]",
                 "dp_cp groups     [0, 2] [1, 3] [4, 6] [5, 7]"):
        assert line in mod.__doc__
    assert Grid(2, 2, 2, "dp-pp-tp").order == ("dp", "pp", "tp", "cp")  # cp follows tp
    with pytest.raises(ValueError, match="cp"):
        Grid(2, 2, 2, "tp-tp-dp-pp")


def test_describe_notes_cp_groups_crossing_nodes():
    assert "cp" not in Grid(2, 2, 2).describe(gpus_per_node=4).split("\n")[0]  # cp=1: as before
    inside = Grid(2, 1, 2, cp=2).describe(gpus_per_node=4)
    assert "cp groups: [0, 2] [1, 3] [4, 6] [5, 7]" in inside and "note: cp" not in inside
    across = Grid(2, 1, 2, "tp-dp-cp-pp", cp=2).describe(gpus_per_node=4)
    assert "note: cp groups [[0, 4], [1, 5], [2, 6], [3, 7]] cross a node boundary" in across
