"""Expert parallelism (`--ep`): the ep / edp groups, the traced all-to-all, and parity of MoE
training under dp x ep (ZeRO-0 to 3) with the one-process run.

Parity: every case trains the same model from the same unsharded weights on the same global batch
as one process that runs each dp rank's slice as one of its micro-batches (so the capacity rule and
the balancing losses see the same tokens: they are per micro-batch), for 3 AdamW steps. float64:
the same rows pass through the same experts, but an expert's matmuls now run over the ep group's
rows at once, and the gradients are summed in another order (an edp average of ep-group sums vs one
rank's accumulation over micro-batches), so float64 rounding (1e-16 relative per sum) is all that
differs: 1e-12 relative on losses and grad norms, 1e-9 relative (1e-14 / 1e-12 absolute) on every
gradient and weight, whose smallest elements Adam's first steps amplify (float32 puts that
amplification at 1e-5 absolute on the expert weights: a bound that could hide a real slip); the
load report and the sigmoid router's biases exactly. The CLI test runs the brief's command line
in float32 against the one-process run: losses within 1e-4.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mini3d.config import ModelConfig, Plan
from mini3d.grid import Grid, build_topology
from mini3d.launch.launcher import launch
from tests.ep_workers import train_cases

BASE = ModelConfig(n_layers=3, d_model=16, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
                   d_ff=32, family="llama", n_experts=4, top_k=2, name="ep-test")
AUX = dataclasses.replace(BASE, aux_loss_coef=0.01, z_loss_coef=1e-3, n_shared_experts=1,
                          dense_layers=1)
CAP = dataclasses.replace(BASE, capacity_factor=1.0)
SIGMOID = dataclasses.replace(BASE, router="sigmoid", router_bias_rate=0.05)
STEPS = 3


# ---- groups ------------------------------------------------------------------------------------
def test_ep_groups_are_carved_out_of_dp_x_cp():
    g = Grid(tp=2, dp=4, ep=2)
    assert g.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [g.coords(r)["ep"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # every dp x cp group is exactly tiled by its ep groups and by its edp groups
    for axis in ("ep", "edp"):
        for dpcp in g.groups("dp"):
            parts = [s for s in g.groups(axis) if set(s) <= set(dpcp)]
            assert sorted(r for s in parts for r in s) == dpcp
    c = Grid(dp=2, cp=2, ep=2)  # cp is next to tp by default: ep pairs the cp ranks
    assert c.groups("ep") == [[0, 1], [2, 3]] and c.groups("edp") == [[0, 2], [1, 3]]
    one = Grid(dp=4)  # ep=1: single ranks, and edp is dp itself
    assert one.groups("ep") == [[0], [1], [2], [3]] and one.groups("edp") == [[0, 1, 2, 3]]
    assert "ep" not in one.coords(1)
    text = g.describe(4)
    assert "ep groups: [0, 2] [1, 3] [4, 6] [5, 7]" in text and "edp groups: [0, 4]" in text
    assert "ep groups" not in one.describe()
    with pytest.raises(ValueError, match="ep=3 must divide dp"):
        Grid(dp=4, ep=3)


def test_topology_axes():
    topo = build_topology(Grid(dp=4, ep=2), 2, make_groups=False)
    assert topo.ep.ranks == (2, 3) and topo.ep.index == 0 and topo.edp.ranks == (0, 2)
    flat = build_topology(Grid(dp=2), 1, make_groups=False)
    assert flat.ep.size == 1 and flat.edp is flat.dp_cp


# ---- parity ------------------------------------------------------------------------------------
def _assert_same(got: dict, ref: dict, clipped: bool = False):
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-12)
    assert len(got["grads"]) == len(ref["grads"]) == STEPS
    for g, r in zip(got["grads"], ref["grads"]):
        assert sorted(g) == sorted(r)
        for n in r:
            torch.testing.assert_close(g[n], r[n], rtol=1e-9, atol=1e-14, msg=n)
    for n, p in ref["params"].items():
        torch.testing.assert_close(got["params"][n], p, rtol=1e-9, atol=1e-12, msg=n)
    for n, b in ref["biases"].items():
        torch.testing.assert_close(got["biases"][n], b, rtol=0, atol=0)
    assert got["loads"] == ref["loads"]
    if clipped:
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-12)


def _assert_ledger_is_estimated(got: dict, cfg, plan):
    """The rank's measured model states (`mini3d.dp.model_state_ledger`) are the estimator's:
    dense states sharded over dp x cp, expert states over edp (`expert_sharding_degree`; ZeRO-3's
    expert pieces kept whole when edp has one member), up to the shard padding (at most dp - 1
    elements a flat group, 16 bytes an element at most: float64 Adam moments)."""
    from mini3d.cost.memory import estimate_memory

    led, est, pad = got["ledger"], estimate_memory(cfg, plan), got["groups"] * (plan.dp - 1) * 16
    assert abs(led["parameters"] - est.params) <= pad, (led, est)
    assert abs(led["gradients"] - est.grads) <= pad, (led, est)
    assert abs(led["master_weights"] + led["optimizer_states"] - est.optimizer) <= pad, (led, est)


def _ref(case):
    cfg, plan, steps, clip = case
    return cfg, plan.replace(dp=1, ep=1, zero=0, micro_batches=plan.dp * plan.micro_batches), \
        steps, clip


PLAN2 = Plan(dp=2, ep=2, global_batch=8, seq_len=16, dtype="float64")
CASES2 = {  # name: (cfg, plan, steps, grad_clip), one 2-rank launch for all
    "dropless": (BASE, PLAN2, STEPS, 0.0),
    "capacity-1.0-aux-z-shared": (dataclasses.replace(AUX, capacity_factor=1.0), PLAN2, STEPS, 0.0),
    "zero1-clip": (AUX, PLAN2.replace(zero=1), STEPS, 0.05),
    "zero2-capacity-2mb": (CAP, PLAN2.replace(zero=2, micro_batches=2), STEPS, 0.0),
    "clip-sigmoid-bias": (SIGMOID, PLAN2, STEPS, 0.05),
    # edp has one member: the expert pieces are kept whole, only the dense ones are sharded
    "zero3-sigmoid-bias": (SIGMOID, PLAN2.replace(zero=3, micro_batches=2), STEPS, 0.0),
}
PLAN4 = PLAN2.replace(dp=4)
CASES4 = {
    "dp4-ep2-zero2-clip-capacity": (dataclasses.replace(AUX, capacity_factor=1.0),
                                    PLAN4.replace(zero=2), STEPS, 0.05),
    "dp4-ep4-zero1": (AUX, PLAN4.replace(ep=4, zero=1), STEPS, 0.0),
    # edp = 2: expert pieces sharded over edp, dense over dp (tiny pieces: several per run)
    "dp4-ep2-zero3-clip": (AUX, PLAN4.replace(zero=3, micro_batches=2, bucket_mb=0.001), STEPS,
                           0.05),
}


# ---- the traced all-to-all ---------------------------------------------------------------------
def _check_all_to_all(res: list):
    """`comm.all_to_all` with uneven splits (rank r sends r + j + 1 rows to member j) is traced
    (event, bytes, wire bytes, splits), its differentiable version's backward is the reverse
    exchange, bad splits and a wrong device are refused before anything is issued."""
    n = len(res)
    for r, out in enumerate(res):
        # from member j: j + r + 1 rows of value 100 j + r (its block for r)
        want = [100.0 * j + r for j in range(n) for _ in range(j + r + 1)]
        assert out["y"] == want
        # the gradient of row i of y is i + 1; it returns to the row's sender, in its order
        got = []
        for j in range(n):  # member j received r + j + 1 rows from r, at j's offset of block r
            start = sum(m + j + 1 for m in range(r))
            got += [float(start + i + 1) for i in range(r + j + 1)]
        assert out["grad"] == got, r
        fwd, bwd = out["events"]
        rows_out, rows_in = sum(r + j + 1 for j in range(n)), sum(j + r + 1 for j in range(n))
        assert fwd == ("ep", 1, (rows_out, 3), rows_out * 12, (rows_out - 2 * r - 1) * 12,
                       (tuple(r + j + 1 for j in range(n)), tuple(j + r + 1 for j in range(n))))
        assert bwd[0] == "ep" and bwd[1] == 2 and bwd[2] == (rows_in, 3)  # same kind: seq 2
        assert bwd[5] == (fwd[5][1], fwd[5][0])  # the reverse exchange
        assert out["bytes"] == fwd[3] + bwd[3] and out["wire"] == fwd[4] + bwd[4]
        assert f"input_splits={[1] * n}" in out["bad_splits"] and f"{n + 1} rows" in out["bad_splits"]
        assert "meta" in out["device"] and "all_to_all on the ep axis" in out["device"]
        assert out["after"] == 2  # neither refused op was recorded or issued


@pytest.mark.timeout(400)
def test_ep_equals_the_one_process_run():
    """Every case of CASES2 / CASES4 against its one-process reference (see the module
    docstring); the 4-rank launch also checks the traced all-to-all (`_check_all_to_all`)."""
    from tests.ep_workers import a2a_and_cases

    cases = {**CASES2, **CASES4}
    refs = launch(train_cases, 1, [_ref(c) for c in cases.values()], device="cpu", timeout=300)[0]
    ref = dict(zip(cases, refs))
    two = launch(train_cases, 2, list(CASES2.values()), device="cpu", timeout=300)
    a2a, four = zip(*launch(a2a_and_cases, 4, list(CASES4.values()), device="cpu", timeout=300))
    _check_all_to_all(list(a2a))
    for results, names in ((two, CASES2), (four, CASES4)):
        for rank_results in results:
            for name, got in zip(names, rank_results):
                _assert_same(got, ref[name], clipped=cases[name][3] > 0)
                _assert_ledger_is_estimated(got, *cases[name][:2])
                assert got["a2a"] > 0 and got["ep_wire"] > 0, name  # the tokens did travel
    assert ref["dropless"]["losses"][-1] < ref["dropless"]["losses"][0]  # it learns
    for name, case in cases.items():  # the clip did act
        assert not case[3] or min(ref[name]["norms"]) > case[3], name
    assert sum(rec["dropped_tokens"] for rec in ref["capacity-1.0-aux-z-shared"]["loads"]) > 0
    assert all(b.abs().sum() > 0 for b in ref["clip-sigmoid-bias"]["biases"].values())


# ---- the command line --------------------------------------------------------------------------
BRIEF = ["train", "--family", "llama", "--kv-heads", "2", "--experts", "4", "--top-k", "2"]


@pytest.mark.timeout(400)
def test_cli_dp2_ep2_equals_the_one_process_run(tmp_path):
    """The command line verbatim (float32, the default model, 3 steps) against one process
    running the two dp slices as two micro-batches: losses within 1e-4, the load report equal."""
    import json

    from tests.test_train_cli import run_cli

    logs = {}
    for name, extra in (("ep", ["--dp", "2", "--ep", "2"]), ("one", ["--micro-batches", "2"])):
        logs[name] = tmp_path / f"{name}.jsonl"
        r = run_cli(*BRIEF, *extra, "--steps", "3", "--log-jsonl", str(logs[name]), timeout=300)
        assert r.returncode == 0, r.stderr
    recs = {k: [json.loads(line) for line in v.read_text().splitlines()] for k, v in logs.items()}
    assert [x["loss"] for x in recs["ep"]] == pytest.approx([x["loss"] for x in recs["one"]],
                                                             rel=1e-4, abs=1e-4)
    for a, b in zip(recs["ep"], recs["one"]):
        assert {k: v for k, v in a.items() if k.startswith("expert_load") or k == "dropped_tokens"} \
            == {k: v for k, v in b.items() if k.startswith("expert_load") or k == "dropped_tokens"}
        assert "expert_load_max" in a


def test_dry_run_records_the_all_to_alls(capsys):
    from mini3d.config import Plan
    from mini3d.run.dryrun import record_programs

    cfg = dataclasses.replace(BASE, n_layers=2)
    progs, grid = record_programs(cfg, Plan(dp=4, ep=4, global_batch=4, seq_len=16))
    assert grid.ep == 4  # ep is kept whole (dp is capped at 2 only without it)
    for prog in progs:
        a2a = [op for what, _, op in prog if what == "issue" and op[2].startswith("all_to_all")]
        # per MoE layer: counts, dispatch, combine forward; combine, dispatch backward
        assert len(a2a) == 2 * 5 and all(op[1] == ("ep", (0, 1, 2, 3)) for op in a2a)
    from mini3d.cli import main

    assert main([*BRIEF, "--dp", "2", "--ep", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ep groups: [0, 1]" in out and "deadlock-free" in out
    # the default model: 4 MoE layers, one micro-batch of 4 x 64 tokens per rank, d_model 64:
    # 5 all-to-alls per layer (the counts, then 4 as recorded above), each sending
    # 256 x top_k 2 x 1/2 x 64 x 4 B = 64 KiB of rows under balanced routing: 4 x 4 x 64 KiB
    assert "20 all-to-alls on the ep group" in out and "sending 1.00 MiB" in out
    # ZeRO-3 under ep (no longer refused): its per-unit gathers, expert pieces on edp, record
    # deadlock-free too
    assert main([*BRIEF, "--dp", "2", "--ep", "2", "--zero", "3", "--dry-run"]) == 0
    assert "deadlock-free" in capsys.readouterr().out


# ---- checkpoints -------------------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_checkpoint_holds_the_full_experts_and_resumes_in_any_layout(tmp_path):
    """A dp2 x ep2 run (ZeRO-3, float64) saves the full stacked experts (gathered over edp and
    ep, in expert order) and their moments; resumed under ep (ZeRO-3 and ZeRO-1) it continues
    exactly, and resumed on one process (the experts sliced nowhere) it continues with the same
    losses: a gather in the wrong order or a slice of the wrong rows would change them."""
    import os

    from mini3d.run.train import make_spec, reporter_records
    from mini3d.checkpoint.store import read_states
    from tests.threed_workers import run_specs

    cfg = dataclasses.replace(AUX, vocab_size=256)
    plan = Plan(dp=2, ep=2, zero=3, global_batch=4, seq_len=16, dtype="float64")
    spec = lambda p, **kw: make_spec(cfg, p, steps=4, seed=2, lr=1e-2, **kw)
    full, step2 = str(tmp_path / "full"), os.path.join(str(tmp_path / "full"), "step-000002")
    first = launch(run_specs, 2, [spec(plan, save=full, save_every=2), spec(plan, resume=step2),
                                  spec(plan.replace(zero=1), resume=step2)], device="cpu",
                   timeout=300)
    whole, *resumed = (reporter_records([r[i] for r in first]) for i in range(3))
    for run in resumed:
        assert [r["loss"] for r in run] == pytest.approx([r["loss"] for r in whole[2:]], rel=1e-12)
    saved = read_states(step2)  # (sharded: assembled from every rank's share)
    for layer in (1, 2):
        name = f"blocks.{layer}.mlp.experts.w_up"
        assert saved["model"][name].shape == (cfg.n_experts, cfg.moe_width, cfg.d_model)
        assert saved["optim"][name]["exp_avg"].shape == saved["model"][name].shape
    one = launch(run_specs, 1, [spec(plan.replace(dp=1, ep=1, zero=0, micro_batches=2),
                                     resume=step2)], device="cpu", timeout=300)[0]
    assert [r["loss"] for r in reporter_records(one)] == \
        pytest.approx([r["loss"] for r in whole[2:]], rel=1e-10)
