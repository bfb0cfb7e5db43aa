"""Batched point-to-point (`comm.batch_p2p`) on gloo, the launcher's check of every run's p2p
programs under NCCL's rules (MINI3D_CHECK_P2P=1, set by conftest.py), and `device_id` on CUDA."""

import pytest
import torch

from mini3d.launch import launcher as launch_mod
from mini3d.launch.p2p_record import P2POrderError, pair_mismatch
from mini3d.launch.launcher import launch
from tests import p2p_workers


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 4])
def test_batch_p2p_runs_a_ring_on_gloo_and_logs_one_batch_per_exchange(n):
    out = launch(p2p_workers.ring_batches, n, 3, device="cpu", timeout=120,
                 env={"MINI3D_CHECK_P2P": "1"})
    for r, o in enumerate(out):
        assert o["got"] == [float(((r - 1) % n) * 10 + t) for t in range(3)]
        assert o["batches"] == 3 and o["events"] == 6 and o["pending"] == 0


@pytest.mark.timeout(180)
def test_the_launcher_rejects_a_send_send_crossing_gloo_runs():
    with pytest.raises(P2POrderError, match="rank 0's op 0 toward rank 1 is send .*rank 1's op 0"):
        launch(p2p_workers.crossing_sends, 2, device="cpu", timeout=120,
               env={"MINI3D_CHECK_P2P": "1"})
    launch(p2p_workers.crossing_sends, 2, device="cpu", timeout=120, env={"MINI3D_CHECK_P2P": "0"})


@pytest.mark.timeout(180)
def test_the_launcher_rejects_the_old_ring_at_cp3_a_pair_communicator_cycle():
    with pytest.raises(P2POrderError, match="pair communicator"):
        launch(p2p_workers.ring_batches, 3, 1, True, device="cpu", timeout=120,
               env={"MINI3D_CHECK_P2P": "1"})


def _rec(*ops):
    return [("issue", (0, i), (k, peer, f"{k} x", b, (2,), "float32"))
            for i, (k, peer, b) in enumerate(ops)]


def test_pair_check_matches_batches_as_units_and_names_the_position():
    assert pair_mismatch([_rec(("send", 1, None), ("recv", 1, None)),
                          _rec(("recv", 0, None), ("send", 0, None))]) is None
    assert pair_mismatch([_rec(("recv", 1, 5), ("send", 1, 5)),
                          _rec(("send", 0, 6), ("recv", 0, 6))]) is None  # order free in a batch
    bad = pair_mismatch([_rec(("send", 1, None), ("recv", 1, None)),
                         _rec(("recv", 0, None))])
    assert "rank 0's op 1 toward rank 1 is recv x" in bad and "is nothing" in bad


def test_device_id_is_passed_on_cuda_only(monkeypatch):
    """And the threads: a CUDA rank under torchrun gets its share of the node's cores (here all
    16 of one rank's), a CPU rank keeps torchrun's OMP_NUM_THREADS (nothing is set)."""
    calls, threads = [], []
    monkeypatch.setattr(launch_mod.torch, "set_num_threads", threads.append)  # (not this process')
    monkeypatch.setattr(launch_mod.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("MINI3D_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(launch_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch_mod.dist, "init_process_group", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(launch_mod, "enter_strict_device", lambda: None)
    for kind, want in (("cuda", torch.device("cuda:1")), ("cpu", None)):
        monkeypatch.setattr(launch_mod, "choose_device", lambda *a, kind=kind, **k: ("x", kind))
        monkeypatch.setattr(launch_mod, "_set_device", lambda t, r, w, kind=kind: monkeypatch.setenv(
            "MINI3D_DEVICE", "cuda:1" if kind == "cuda" else "cpu"))
        launch_mod.init_from_env()
        assert calls[-1]["device_id"] == want
    assert threads == [16]
