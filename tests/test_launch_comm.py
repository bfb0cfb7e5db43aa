import os
import time

import pytest

from mini3d.launch.launcher import LaunchTimeout, WorkerError, launch
from tests import workers


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _pids(tmp_path):
    return [int(p.read_text()) for p in tmp_path.glob("pid*")]


@pytest.mark.timeout(120)
def test_launch_returns_each_ranks_result(tmp_path):
    out = launch(workers.rank_info, 4, 10, timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert [o["value"] for o in out] == [0, 10, 20, 30]
    assert all(o["world"] == 4 for o in out)
    time.sleep(0.2)
    assert not any(_alive(o["pid"]) for o in out)


@pytest.mark.timeout(120)
def test_raising_worker_ends_job_with_its_traceback(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as e:
        launch(workers.write_pid_then, 3, str(tmp_path), "raise", timeout=60)
    assert e.value.rank == 1
    assert "boom" in str(e.value) and "write_pid_then" in e.value.traceback
    assert time.monotonic() - t0 < 40  # did not wait for the timeout
    pids = _pids(tmp_path)
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


@pytest.mark.timeout(120)
def test_hanging_worker_is_stopped_by_timeout(tmp_path):
    with pytest.raises(LaunchTimeout) as e:
        # 20 s: long enough for both ranks to start (import torch, rendezvous) on a loaded machine
        launch(workers.write_pid_then, 2, str(tmp_path), "hang", timeout=20)
    assert 1 in e.value.pending
    pids = _pids(tmp_path)
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


@pytest.mark.timeout(120)
def test_comm_log_records_ops_axes_sequence_and_bytes():
    out = launch(workers.comm_ops, 4, 2, 2, 1, timeout=60)  # tp=2, pp=2
    for o in out:
        assert o["ar"] == [[3.0] * 4] * 3  # 1 + 2
        assert o["ag"] == [0.0] * 3 + [1.0] * 3
        assert o["rs"] == [[2.0] * 4] * 2
        ev = [e for e in o["events"] if e["axis"] == "tp"]
        assert [e["op"] for e in ev] == ["all_reduce", "all_gather", "reduce_scatter", "all_reduce"]
        assert [e["seq"] for e in ev] == [1, 1, 1, 2]
        assert all(e["end"] is not None and e["end"] >= e["start"] for e in ev)
        # payload bytes: 3x4 fp32 = 48; gather output 6x4 = 96; reduce-scatter input 4x4 = 64; 5 fp32 = 20
        assert [e["bytes"] for e in ev] == [48, 96, 64, 20]
        # ring bytes one rank sends, n = 2: all-reduce 2(n-1)/n, the others (n-1)/n
        assert [e["wire_bytes"] for e in ev] == [48, 48, 32, 20]
        assert o["bytes"]["tp"] == 48 + 96 + 64 + 20
        pp_ev = [e for e in o["events"] if e["axis"] == "pp"]
        assert len(pp_ev) == 1 and pp_ev[0]["bytes"] == 24
        assert pp_ev[0]["op"] == ("send" if o["rank"] < 2 else "recv")
        assert pp_ev[0]["peer"] == (o["rank"] + 2) % 4
        if o["rank"] >= 2:
            src = o["rank"] - 2
            assert o["recv"] == [float(i * (src + 1)) for i in range(6)]


@pytest.mark.timeout(120)
def test_each_launch_gives_its_ranks_the_launchers_present(tmp_path, monkeypatch, capfd):
    """Ranks forked from mini3d.launch.zygote's server (started by an earlier launch, with that
    launch's environment, stdio and directory) still get this launch's: what they print reaches
    the launcher's stdout and stderr as they are now, and they see its environment, sys.path and
    working directory. A second launch is served by the same server (the ranks' parent)."""
    import sys

    saved = [os.dup(1), os.dup(2)]  # a first launch with other stdio: it may start the server
    with open(tmp_path / "elsewhere.txt", "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            launch(workers.rank_info, 2, 1, timeout=60)
        finally:
            for fd, target in zip(saved, (1, 2)):
                os.dup2(fd, target)
                os.close(fd)
    seen = []
    for i in range(2):
        monkeypatch.setenv("MINI3D_TEST_GIVEN", f"value {i}")
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path / f"extra{i}"))
        out = launch(workers.what_the_launcher_gave, 2, f"launch{i}", timeout=60)
        got = capfd.readouterr()
        for r in range(2):
            assert f"launch{i} out of rank {r}" in got.out and f"launch{i} err of rank {r}" in got.err
        assert all(o["env"] == f"value {i}" and o["cwd"] == str(tmp_path) for o in out)
        assert all(o["path"][:len(sys.path)] == sys.path for o in out)
        seen.append({o["ppid"] for o in out})
    assert len(seen[0]) == 1 and seen[0] == seen[1] and os.getpid() not in seen[0]


@pytest.mark.timeout(120)
def test_ranks_get_one_thread_on_cpu_and_a_share_of_the_cores_on_cuda(monkeypatch):
    """CPU ranks share the cores, so each gets 1 thread; $MINI3D_THREADS (or threads=) overrides
    it. A CUDA rank's CPU work (pinned copies, checkpoint writes) gets the node's cores divided
    among its ranks, not 1 (worker_threads is what launch and init_from_env apply)."""
    from mini3d.launch import launcher

    assert launch(workers.threads_here, 2, timeout=60) == [1, 1]
    monkeypatch.setenv(launcher.THREADS_ENV, "2")
    assert launch(workers.threads_here, 2, timeout=60) == [2, 2]
    assert launch(workers.threads_here, 2, timeout=60, threads=3) == [3, 3]  # the argument wins
    monkeypatch.delenv(launcher.THREADS_ENV)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert launcher.worker_threads("cuda", 4) == 4 and launcher.worker_threads("cuda", 32) == 1
    assert launcher.worker_threads("cpu", 4) == 1
    for bad in ("two", "0"):
        monkeypatch.setenv(launcher.THREADS_ENV, bad)
        with pytest.raises(launcher.LaunchError, match="MINI3D_THREADS"):
            launcher.worker_threads("cpu", 2)
