"""The dry run's expert-parallel line (issue #30): one line per run, its all-to-all bytes the cost
model's (`mini3d.cost.comm_time.ep_wire_bytes`, the one formula, per pipeline stage) and its
all-to-all counts the recorded step's; and those bytes are what the recorded step's all-to-alls
carry: every dispatch and combine buffer (forward, backward, and the forward's again under full
recompute) of the real Trainer on the fake process group, times the (ep-1)/ep of balanced routing
(the fake group returns each rank its own counts, so the recorded splits are not balanced; the
buffers are the real sizes). The layouts change what a rank routes: sequence parallelism (tokens
/ tp), tp without it (every tp rank routes the same tokens), cp (s / cp), a stage with a dense
layer (dense_layers=1), full recompute. The old line counted every MoE layer on every stage and
ignored the /tp of sequence parallelism."""

from __future__ import annotations

import pytest

from mini3d.config import ModelConfig, Plan
from mini3d.cost.comm_time import ep_wire_bytes
from mini3d.grid import Grid
from mini3d.run.dryrun import dry_run, record_rank, recording_setup

CFG = ModelConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
                  d_ff=32, family="llama", n_experts=4, top_k=2, dense_layers=1, name="ep-dry")
PLANS = {
    "tp2-sp-pp2-dp2-ep2-full": Plan(tp=2, pp=2, dp=2, ep=2, sequence_parallel=True, micro_batches=2,
                                    global_batch=4, seq_len=16, recompute="full"),
    "tp2-cp2-ep2": Plan(tp=2, cp=2, ep=2, global_batch=2, seq_len=16),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", PLANS)
def test_the_ep_line_is_the_cost_model_and_the_recorded_step(name):
    plan = PLANS[name]
    cfg, rplan = recording_setup(CFG, plan)
    assert cfg is CFG and rplan.dp == plan.dp  # recorded as is: sizes comparable
    grid = Grid(plan.tp, plan.pp, plan.dp, cp=plan.cp, ep=plan.ep)
    counts, sent = [], []
    for s, rank in enumerate(grid.groups("pp")[0]):  # one rank of each stage
        a2a = [ev for what, _, ev in record_rank(CFG, plan, rank) if what == "issue"
               and ev["op"] == "all_to_all"]
        rows = [ev for ev in a2a if "float" in ev["dtype"]]  # not the counts exchange
        ep_group = next(tuple(g) for g in grid.groups("ep") if rank in g)
        assert rows and all(ev["group"] == ep_group for ev in rows)
        counts.append(len(a2a))
        sent.append(sum(ev["bytes"] for ev in rows) * (plan.ep - 1) / plan.ep)
        assert sent[s] == pytest.approx(plan.micro_batches * ep_wire_bytes(CFG, plan, s), rel=1e-12)
    if plan.pp > 1:
        assert sent[0] < sent[1]  # stage 0 holds the dense layer
    lines = []
    assert dry_run(CFG, plan, out=lines.append) == 0
    ep = [line for line in lines if "all-to-all" in line]
    assert len(ep) == 1, ep  # once, not twice
    for s, (n, b) in enumerate(zip(counts, sent)):
        stage = f"stage {s}: " if plan.pp > 1 else ""
        assert f"{stage}{n} all-to-alls on the ep group, sending {b / 2**20:,.2f} MiB ({b:,.0f} B" in ep[0]
    assert any(f"dp={plan.dp} ep={plan.ep} slice" in line for line in lines)  # the recorded layout
