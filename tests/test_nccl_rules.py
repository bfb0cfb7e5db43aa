"""The program checker under NCCL's ordering rules (mini3d.diagnose.rendezvous), on hand-written
programs: per-pair streams in issue order, a send waiting for its receive, batches as one unit, and
the blocking join that creates a pair communicator on first use."""

import pytest

from mini3d.diagnose.rendezvous import simulate
from mini3d.grid import Grid


def ring(n: int, batched: bool) -> list[list]:
    """Each cp rank posts a send to the next and a receive from the previous, then waits for both
    (ring attention's exchange, old: two plain ops; new: one batch)."""
    progs = []
    for r in range(n):
        b = ("x", 0) if batched else None
        send, recv = ("send", (r + 1) % n, "send kv", b), ("recv", (r - 1) % n, "recv kv", b)
        progs.append([("issue", 0, send), ("issue", 1, recv), ("wait", 0, send), ("wait", 1, recv)])
    return progs


def test_old_ring_deadlocks_at_cp2_both_ranks_send_first():
    hang = simulate(ring(2, batched=False), Grid(cp=2))
    assert hang and "rank 0" in hang and "rank 1" in hang and "queued behind" in hang
    assert simulate(ring(2, batched=False), Grid(cp=2), device_id=True)  # a stream-order hang
    assert simulate(ring(2, batched=False), Grid(cp=2), rules="gloo") is None  # gloo's rules pass it


@pytest.mark.parametrize("n", [3, 4])
def test_old_ring_deadlocks_at_cp3_and_cp4_on_the_pair_communicator_cycle(n):
    hang = simulate(ring(n, batched=False), Grid(cp=n))
    assert hang and all(f"rank {r} " in hang for r in range(n)) and "pair communicator" in hang
    assert simulate(ring(n, batched=False), Grid(cp=n), device_id=True) is None  # no join: it runs


@pytest.mark.parametrize("n", [2, 3, 4])
def test_batched_ring_passes(n):
    assert simulate(ring(n, batched=True), Grid(cp=n)) is None
    assert simulate(ring(n, batched=True), Grid(cp=n), rules="gloo") is None


def _blocking(kind, peer, label, batch=None):
    return (kind, peer, label) if batch is None else (kind, peer, label, batch)


def test_1f1b_pipeline_program_passes():
    """mini3d's 1F1B lists for p=2, m=3 (blocking receives, sends posted then waited at the end):
    rank 0's transfers toward rank 1 mirror rank 1's from rank 0 one for one."""
    r0 = ["sF0", "sF1", "rB0", "sF2", "rB1", "rB2"]
    r1 = ["rF0", "rF1", "sB0", "rF2", "sB1", "sB2"]

    def prog(acts, peer):
        out, sends = [], []
        for i, a in enumerate(acts):
            op = ("send" if a[0] == "s" else "recv", peer, a)
            out.append(("issue", i, op))
            (sends.append(("wait", i, op)) if a[0] == "s" else out.append(("wait", i, op)))
        return out + sends

    assert simulate([prog(r0, 1), prog(r1, 0)], Grid(pp=2)) is None
    crossed = ["rF0", "sB0", "rF1", "rF2", "sB1", "sB2"]  # rank 1 sends B0 before receiving F1
    hang = simulate([prog(r0, 1), prog(crossed, 0)], Grid(pp=2))
    assert hang and "rank 0" in hang and "rank 1" in hang


def test_send_send_crossing_fails_and_a_batched_exchange_passes():
    crossing = [[("send", 1, "a"), ("recv", 1, "b")], [("send", 0, "c"), ("recv", 0, "d")]]
    hang = simulate(crossing, Grid(pp=2))
    assert "rank 0 " in hang and "rank 1 " in hang and "send a to rank 1" in hang
    progs = []
    for r in range(2):
        s, v = ("send", 1 - r, "s", 7), ("recv", 1 - r, "r", 7)
        progs.append([("issue", 0, s), ("issue", 1, v), ("wait", 0, s), ("wait", 1, v)])
    assert simulate(progs, Grid(pp=2)) is None


def test_collectives_complete_in_issue_order_per_communicator():
    g1, g2 = ("coll", ("tp", (0, 1)), "all_reduce a"), ("coll", ("dp", (0, 1)), "all_reduce b")
    same = [[("issue", 0, g1), ("issue", 1, g2), ("wait", 1, g2), ("wait", 0, g1)]] * 2
    assert simulate(same, Grid(tp=2)) is None  # two communicators: no order between them
    swapped = [[g1, g2], [g2, g1]]
    hang = simulate(swapped, Grid(tp=2))
    assert hang and "rank 0" in hang and "rank 1" in hang


def test_an_unknown_rule_set_is_an_error():
    with pytest.raises(ValueError, match="nccl or gloo"):
        simulate([[]], Grid(), rules="mpi")
