"""Multi-node shape on one machine: two torchrun agents act as two "nodes" of 2 processes each.

`torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d` on loopback, running
`mini3d train --tp 2 --dp 2`, must give the losses of the same layout spawned by plain `mini3d train`.
Cleanup: torchrun starts each worker in a session of its own, so killing the agents' process groups
is not enough; every process we start carries a marker in its environment, and the `finally` kills
each process (by pid) whose environment holds this test's marker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from mini3d import cli
from mini3d.grid import Grid
from mini3d.launch.launcher import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["train", "--tp", "2", "--dp", "2", "--hidden", "32", "--global-batch", "8", "--seq-len", "16",
         "--steps", "3", "--seed", "11", "--no-progress", "--device", "cpu"]


def _pids_with_marker(marker: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def _kill_marked(marker: str):
    for pid in _pids_with_marker(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _two_nodes(args: list[str], nproc: int = 2) -> tuple[list[int], list[str]]:
    """Run `python -m mini3d ARGS` as two torchrun "nodes" of `nproc` processes on loopback;
    (the agents' exit statuses, their outputs), with no process left behind."""
    marker = f"MINI3D_TEST_MULTINODE={uuid.uuid4().hex}"
    key, value = marker.split("=")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", **{key: value})
    port = free_port()
    agents = []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                   str(nproc), "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"127.0.0.1:{port}", "--rdzv-id", value[:8], "--local-addr", "127.0.0.1",
                   "--max-restarts", "0", "-m", "mini3d", *args]
            agents.append(subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True))
        outputs = [a.communicate(timeout=180)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait(10)
        _kill_marked(marker)
        time.sleep(0.2)
        survivors = _pids_with_marker(marker)
    assert not survivors, f"processes survived: {survivors}"
    return [a.returncode for a in agents], outputs


@pytest.mark.timeout(240)
def test_two_torchrun_nodes_give_the_losses_of_a_plain_run(tmp_path):
    log = tmp_path / "nodes.jsonl"
    run = tmp_path / "shared-run"  # on a filesystem both "nodes" see
    run.mkdir()
    for stale in ("ABORT", "ABORT-0123456789ab"):  # markers a failed job left: must not stop this one
        (run / stale).write_text('{"by": 1, "reason": "an old failure", "code": 3}')
    codes, outputs = _two_nodes([*TRAIN, "--log-jsonl", str(log), "--run-dir", str(run)])
    for code, out in zip(codes, outputs):
        assert code == 0, out
    assert sum("done: 3 steps" in out for out in outputs) == 1  # one reporter, on one of the nodes
    nodes = [json.loads(line)["loss"] for line in log.read_text().splitlines()]

    plain_log = tmp_path / "plain.jsonl"
    assert cli.main([*TRAIN, "--log-jsonl", str(plain_log)]) == 0
    plain = [json.loads(line)["loss"] for line in plain_log.read_text().splitlines()]
    assert len(nodes) == 3
    # same layout, same seed, same data, same order of every reduction: bitwise equal
    assert nodes == plain


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault,code,first", [
    ("p2p-order:0:1", 3, "rank 0 (tp=0, pp=0, dp=0) is in a point-to-point order deadlock"),
    ("raise:1:1", 1, "rank 1 (tp=0, pp=1, dp=0) crashed with RuntimeError: injected fault"),
])
def test_a_failure_under_torchrun_is_handled_as_in_a_plain_run(tmp_path, fault, code, first):
    """Two one-process nodes (pp=2): every rank dumps to the shared run directory, one report
    names the culprit first, and each worker exits with mini3d's code (torchrun's summary)."""
    run = tmp_path / "shared-run"
    args = ["train", "--pp", "2", "--micro-batches", "2", "--hidden", "32", "--global-batch", "4", "--seq-len", "16",
            "--steps", "3", "--no-progress", "--device", "cpu", "--hang-timeout", "3",
            "--inject-fault", fault, "--run-dir", str(run)]
    codes, outputs = _two_nodes(args, nproc=1)
    both = "\n".join(outputs)
    assert all(c != 0 for c in codes), both
    reports = [line for line in both.splitlines() if line.startswith("mini3d train: rank")]
    assert len(reports) == 1 and reports[0].startswith("mini3d train: " + first), both
    assert f"exitcode  : {code}" in both, both  # torchrun's summary of the failed worker(s)
    job, = run.glob("job-*")  # the job's own directory in the shared run directory
    assert (job / "rank0.json").exists() and (job / "rank1.json").exists()
    for r in (0, 1):  # torch's automatic dump (an NCCL timeout) goes to the job's directory too
        recorder = json.loads((job / f"rank{r}.json").read_text())["flight_recorder"]
        assert recorder == str(job / "nccl_trace_rank_"), recorder
    assert "terminate called" not in both


def test_several_torchrun_nodes_need_a_shared_run_dir(monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    assert cli.main(TRAIN) == 2
    assert "--run-dir is required" in capsys.readouterr().err


def test_grid_reports_node_boundaries():
    good = Grid(2, 1, 2).describe(gpus_per_node=2)  # tp fastest: tp groups [0,1] [2,3]
    assert "node    0   0   1   1" in good
    assert "every tp group stays inside one node" in good and "WARNING" not in good
    assert Grid(2, 1, 2).crossing_groups("tp", 2) == []
    assert Grid(2, 1, 2).crossing_groups("dp", 2) == [[0, 2], [1, 3]]  # dp crosses, as intended
    bad_grid = Grid(2, 1, 2, order="dp-pp-tp")  # tp slowest: tp groups [0,2] [1,3] span both nodes
    bad = bad_grid.describe(gpus_per_node=2)
    assert bad_grid.groups("tp") == [[0, 2], [1, 3]]
    assert "WARNING: tp groups [[0, 2], [1, 3]] cross a node boundary" in bad
