"""NCCL's ordering rules on real layouts: the point-to-point calls of any two ranks match one for one
in issue order (batches as units) at cp=2, cp=4, cp2 x pp2 and zero-bubble V (zbv, pp2), and the
dry run proves ring attention deadlock-free under NCCL's rules, while the old exchange (a plain send
then a receive) is reported as the deadlock it is on NCCL."""

import dataclasses

import pytest

from mini3d.cli import main
from mini3d.comm import send, recv
from mini3d.config import ModelConfig, Plan
from mini3d.diagnose.p2p_order import program_deadlock
from mini3d.launch.p2p_record import pair_mismatch
from mini3d.launch.launcher import launch
from tests import p2p_workers

CFG = ModelConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, max_seq_len=32)
BASE = dict(global_batch=4, seq_len=16)
LAYOUTS = [
    ("cp2", Plan(cp=2, micro_batches=2, **BASE)),
    ("cp4", Plan(cp=4, micro_batches=1, **BASE)),
    ("cp2-pp2", Plan(cp=2, pp=2, micro_batches=2, **BASE)),
    ("pp2-zbv", Plan(pp=2, schedule="zbv", virtual_stages=2, micro_batches=4, **BASE)),
]


@pytest.mark.timeout(300)
def test_real_layouts_match_pairwise_in_issue_order():
    cases = [{"name": n, "plan": dataclasses.asdict(p)} for n, p in LAYOUTS]
    results = launch(p2p_workers.layouts_p2p, 4, cases, dataclasses.asdict(CFG), device="cpu",
                     timeout=280, env={"MINI3D_CHECK_P2P": "1"})
    for i, (name, plan) in enumerate(LAYOUTS):
        records = [per_rank[i]["record"] for per_rank in results[:plan.world_size]]
        ops = [op for rec in records for what, _, op in rec if what == "issue"]
        assert ops, name  # the step did communicate point to point
        batched = {op[3] is not None for op in ops}
        if plan.pp == 1:  # only the ring: every exchange is a batch
            assert batched == {True}, name
        elif plan.cp > 1:  # the ring's batches and the pipeline's plain sends and receives
            assert batched == {True, False}, name
        assert pair_mismatch(records) is None, name
        assert program_deadlock(records) is None, name


def _old_exchange(tensor, axis):
    """ring.py's exchange before the fix: a plain send to the next cp rank, then a receive."""
    import torch

    incoming = torch.empty_like(tensor)
    return incoming, [send(tensor, axis, axis.peer(1), async_op=True),
                      recv(incoming, axis, axis.peer(-1), async_op=True)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp", ["2", "4"])
def test_dry_run_of_ring_attention_is_deadlock_free_under_nccl_rules(cp, capsys, monkeypatch):
    args = ["train", "--dry-run", "--cp", cp, "--seq-len", "16", "--micro-batches", "1"]
    assert main(args) == 0
    assert "communication: deadlock-free" in capsys.readouterr().out
    from mini3d.cp import ring

    monkeypatch.setattr(ring, "_exchange", _old_exchange)
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "communication: deadlock: rank 0" in out and "rank 1" in out
    assert ("queued behind" if cp == "2" else "pair communicator") in out
