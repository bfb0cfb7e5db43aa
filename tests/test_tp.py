"""Tensor parallelism: parity with the single-process reference, communication counts, bad input.

One 4-rank launch (module fixture) runs tp=2 (two groups) and tp=4, each without and with sequence
parallelism; tp=1 runs in-process through the same code. The model has a vocabulary (251) that
neither 2 nor 4 divides, so vocabulary padding is exercised everywhere.
"""

import collections
import dataclasses

import pytest
import torch

from mini3d.config import ModelConfig, Plan, PRESETS
from mini3d.grid import Axis, Grid, build_topology
from mini3d.launch.launcher import launch
from mini3d.models.transformer import GPT
from mini3d.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, apply_tp,
                       boundary_shape, comm_per_layer, shard_map)
from mini3d.tp.layers import head_index
from tests import tp_workers

CFG = ModelConfig(n_layers=2, d_model=32, n_heads=4, vocab_size=251, max_seq_len=32)

# Tolerances (float32 throughout).
# Loss: ~5.5, whose float32 spacing is 4.8e-7; split matmuls + all-reduce only reorder sums, so a
# few ulps. A wrong shard or a missing reduction changes the loss in the 3rd digit or worse.
LOSS_ATOL = 2e-6
# Gradients: entries are O(1e-3..0.3); each is a sum of at most B*T*d_ff = 4096 float32 products, so
# reordering changes it by ~1e-7 relative; we saw <= 1e-6 absolute. A sharding/reduction bug gives
# errors of the size of the gradient itself (or a factor tp), orders of magnitude above this.
GRAD_ATOL, GRAD_RTOL = 5e-6, 1e-4
# Parameters after 3 AdamW steps (lr 1e-3): Adam divides by sqrt(v), so tiny gradient differences
# on near-zero gradients are amplified; we saw <= 5e-6. Still 20x below one step (lr), which a
# wrong update would show.
PARAM_ATOL = 5e-5


def _check_parity(o, label):
    assert o["keys_match"], label
    assert o["bit_equal_start"], f"{label}: sharded start is not bit-equal to the reference"
    assert len(o["loss"]) == 3
    for step, (ours, ref) in enumerate(o["loss"]):
        assert abs(ours - ref) <= LOSS_ATOL, f"{label} step {step}: loss {ours} vs {ref}"
    for step, diffs in enumerate(o["grad"]):
        assert set(diffs) == {n for n, _ in GPT(CFG, 0).named_parameters()}
        for name, (d, scale) in diffs.items():
            assert d <= GRAD_ATOL + GRAD_RTOL * scale, f"{label} step {step}: grad {name} off by {d}"
    for step, diffs in enumerate(o["param"]):
        for name, (d, _) in diffs.items():
            assert d <= PARAM_ATOL, f"{label} after step {step}: param {name} off by {d}"
    assert o["reload_exact"], f"{label}: load_full_state_dict / full_state_dict round trip"
    p = o["pipeline"]
    assert p["shape_ok"], f"{label}: stage boundary {p['shape']}"
    assert abs(p["loss"][0] - p["loss"][1]) <= LOSS_ATOL, label
    assert p["logits_diff"] <= 1e-5, f"{label}: gathered logits off by {p['logits_diff']}"  # ~1e-7
    for name, (d, scale) in p["grad"].items():
        assert d <= GRAD_ATOL + GRAD_RTOL * scale, f"{label} pipeline stages: grad {name} off by {d}"


@pytest.fixture(scope="module")
def tp_runs():
    out = launch(tp_workers.tp_job, 4, dataclasses.asdict(CFG), timeout=240)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_parity_multi_rank(tp_runs, tp, sp):
    for o in tp_runs:
        _check_parity(o["results"][(tp, sp)], f"rank {o['rank']} tp={tp} sp={sp}")


@pytest.mark.timeout(300)
def test_mappings_forward_and_backward(tp_runs):
    for o in tp_runs:
        for tp, checks in o["mappings"].items():
            assert len(checks) == 7
            for name, (fwd, bwd) in checks.items():
                # sums of at most 4 float32 numbers of size ~3: exact to ~1e-6
                assert fwd <= 1e-5 and bwd <= 1e-5, f"rank {o['rank']} tp={tp} {name}: {fwd}, {bwd}"


@pytest.mark.timeout(120)
def test_parity_tp1_same_code_path():
    out = tp_workers.tp1_run(dataclasses.asdict(CFG))
    for sp, o in out.items():
        _check_parity(o, f"tp=1 sp={sp}")
        assert o["events"] == []  # a one-member axis communicates nothing


def _expected_events(t, sp):
    """(phase, op) -> [count, bytes, wire_bytes]: L layers by `comm_per_layer`, plus the embedding,
    head and loss collectives, accounted for separately here."""
    B, T, C, L = tp_workers.BATCH, tp_workers.SEQ, CFG.d_model, CFG.n_layers
    P, N = B * T * C * 4, B * T
    exp = collections.defaultdict(lambda: [0, 0, 0])

    def add(phase, op, count, nbytes):
        wire = (2 if op == "all_reduce" else 1) * (t - 1) * nbytes // t
        e = exp[(phase, op)]
        e[0], e[1], e[2] = e[0] + count, e[1] + count * nbytes, e[2] + count * wire

    per_layer = comm_per_layer(t, B, T, C, sp, 4)
    for phase, key in (("fwd", "forward"), ("bwd", "backward")):
        for op in per_layer[key]:
            add(phase, op["op"], L * op["count"], op["bytes"])
    add("fwd", "all_reduce", 1, N * 4)  # loss: all-reduce max of N logits
    add("fwd", "all_reduce", 1, 2 * N * 4)  # loss: all-reduce [sum exp, target logit]
    if sp:
        add("fwd", "reduce_scatter", 1, P)  # embedding partial sums -> sequence shard
        add("bwd", "all_gather", 1, P)  # ... its backward
        add("fwd", "all_gather", 1, P)  # head gathers the sequence
        add("bwd", "reduce_scatter", 1, P)  # ... its backward
        replicated = L * 6 * C + CFG.max_seq_len * C + 2 * C  # LNs, row biases; wpe; ln_f
        add("sync", "all_reduce", 1, replicated * 4)  # sync_tp_grads: one flat all-reduce
    else:
        add("fwd", "all_reduce", 1, P)  # embedding `g`
        add("bwd", "all_reduce", 1, P)  # head input `f`
    return dict(exp)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_comm_counts_and_bytes_match_formula(tp_runs, tp, sp):
    for o in tp_runs:
        measured = collections.defaultdict(lambda: [0, 0, 0])
        for phase, op, nbytes, wire in o["results"][(tp, sp)]["events"]:
            if phase != "check":  # the gathers of full_state_dict/full_grads are test scaffolding
                m = measured[(phase, op)]
                m[0], m[1], m[2] = m[0] + 1, m[1] + nbytes, m[2] + wire
        assert dict(measured) == _expected_events(tp, sp), f"rank {o['rank']} tp={tp} sp={sp}"
    if not sp:  # the headline: 2 all-reduces per layer forward and 2 backward (+1 embed / head)
        ev = _expected_events(tp, sp)
        assert ev[("fwd", "all_reduce")][0] == 2 * CFG.n_layers + 1 + 2
        assert ev[("bwd", "all_reduce")][0] == 2 * CFG.n_layers + 1


def test_comm_per_layer_formula():
    P = 2 * 16 * 32 * 4
    plain = comm_per_layer(4, 2, 16, 32, False, 4)
    assert plain["forward"] == [{"op": "all_reduce", "count": 2, "bytes": P,
                                 "wire_bytes": 2 * 3 * P // 4}]
    assert plain["forward_ops"] == plain["backward_ops"] == 2
    seq = comm_per_layer(4, 2, 16, 32, True, 4)
    assert {o["op"] for o in seq["forward"]} == {"all_gather", "reduce_scatter"}
    assert seq["forward_ops"] == seq["backward_ops"] == 4
    # sequence parallelism moves the same wire volume as the all-reduces it replaces
    assert seq["forward_wire_bytes"] == plain["forward_wire_bytes"] == 3 * P
    assert comm_per_layer(1, 2, 16, 32, False, 4)["forward_ops"] == 0
    assert comm_per_layer(2, 1, 8, 16, False, 2)["forward_bytes"] == 2 * 8 * 16 * 2


def test_bad_tp_rejected_with_values_named(tiny):
    msgs = Plan(tp=3).problems(tiny)
    assert any("tp=3" in m and "n_heads=4" in m and "[1, 2, 4]" in m for m in msgs), msgs
    cfg = ModelConfig(d_model=64, n_heads=8, d_ff=100)
    msgs = Plan(tp=8).problems(cfg)
    assert any("tp=8" in m and "d_ff=100" in m for m in msgs), msgs
    assert not any("n_heads" in m for m in msgs), msgs  # 8 divides n_heads=8: not blamed
    msgs = Plan(tp=4, seq_len=30, sequence_parallel=True).problems(tiny)
    assert any("tp=4" in m and "seq_len=30" in m for m in msgs), msgs
    topo = build_topology(Grid(tp=1), 0, make_groups=False)
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_heads=4.*plan.tp=3 != .* 1"):
        apply_tp(GPT(tiny, 0), topo, Plan(tp=3))


def test_shard_map_matches_the_layers_slices():
    tp, full = 4, GPT(CFG, 0)
    smap = {e["name"]: e for e in shard_map(CFG, tp)}
    blk = full.blocks["0"]
    mods = {"embed.wte.weight": (full.embed.wte, VocabParallelEmbedding),
            "blocks.*.attn.qkv.weight": (blk.attn.qkv, ColumnParallelLinear),
            "blocks.*.attn.proj.weight": (blk.attn.proj, RowParallelLinear),
            "blocks.*.mlp.fc.weight": (blk.mlp.fc, ColumnParallelLinear),
            "blocks.*.mlp.proj.weight": (blk.mlp.proj, RowParallelLinear),
            "head.out.weight": (full.head.out, ColumnParallelLinear)}
    assert set(mods) == set(smap)
    for name, (ref, cls) in mods.items():
        e, W = smap[name], ref.weight.detach()
        assert e["shape"] == tuple(W.shape)
        covered = []
        for r in range(tp):
            axis = Axis("tp", tuple(range(tp)), r)  # construction needs no process group
            kw = {"index": [head_index(CFG.d_model, tp, i) for i in range(tp)]} if "qkv" in name else {}
            shard = cls(ref, axis, **kw).weight.detach()
            key = "rows" if e["dim"] == 0 else "cols"
            idx = [i for a, b in e["ranks"][r][key] for i in range(a, b)]
            real = [i for i in idx if i < W.shape[e["dim"]]]
            expect = W.index_select(e["dim"], torch.tensor(real))
            got = shard.narrow(e["dim"], 0, len(real))
            assert torch.equal(got, expect), f"{name} tp_rank {r}"
            assert not shard.narrow(e["dim"], len(real), len(idx) - len(real)).any()  # zero padding
            covered += real
        assert sorted(covered) == list(range(W.shape[e["dim"]])), name  # each row/col exactly once
    assert smap["head.out.weight"]["padded"] == 252
    assert [r["padding_rows"] for r in smap["head.out.weight"]["ranks"]] == [0, 0, 0, 1]
    assert smap["blocks.*.attn.qkv.weight"]["ranks"][1]["rows"] == [(8, 16), (40, 48), (72, 80)]


def test_boundary_shape():
    assert boundary_shape(Plan(tp=4, seq_len=64), 2, PRESETS["tiny"]) == (2, 64, 64)
    assert boundary_shape(Plan(tp=4, seq_len=64, sequence_parallel=True), 2,
                          PRESETS["tiny"]) == (2, 16, 64)
