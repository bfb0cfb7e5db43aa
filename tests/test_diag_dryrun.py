"""Dry run, fault parsing, OOM report and explain-hang's CLI: no processes are started here."""

import json

import pytest

from mini3d.cli import main
from mini3d.config import PRESETS, Plan
from mini3d.diagnose.rendezvous import simulate
from mini3d.run.dryrun import record_programs
from mini3d.diagnose.faults import Fault, fault_problems, oom_report, parse_fault, parse_size
from mini3d.grid import Grid


@pytest.mark.timeout(60)
def test_dry_run_of_a_valid_plan_prints_the_map_and_proves_the_step(capsys):
    rc = main(["train", "--dry-run", "--tp", "2", "--dp", "2", "--micro-batches", "2",
               "--gpus-per-node", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tp groups: [0, 1] [2, 3]" in out and "dp groups: [0, 2] [1, 3]" in out
    assert "node    0   0   1   1" in out  # --gpus-per-node 2 flags the node of each rank
    assert "communication: deadlock-free: the real step's" in out
    assert "no interleaving" not in out  # it says what it checked, under which semantics
    assert "nothing was started" in out


@pytest.mark.timeout(60)
def test_dry_run_of_a_broken_plan_exits_2_with_the_reason(capsys):
    rc = main(["train", "--dry-run", "--tp", "3"])
    assert rc == 2
    assert "tp=3 does not divide n_heads=4" in capsys.readouterr().err
    rc = main(["train", "--dry-run", "--dp", "2", "--inject-fault", "p2p-order:0:1"])
    assert rc == 2
    assert "p2p-order needs pipeline neighbours" in capsys.readouterr().err


def test_dry_run_pipeline_with_schedules_module_if_present(capsys):
    rc = main(["train", "--dry-run", "--tp", "2", "--pp", "2", "--dp", "2", "--micro-batches", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "check passed" in out and "deadlock-free" in out


def test_simulation_finds_a_p2p_order_deadlock_and_passes_the_fixed_order():
    grid = Grid(1, 2, 1)
    both_recv_first = [[("recv", 1, "rB0.0"), ("send", 1, "sF0.0")],
                       [("recv", 0, "rF1.0"), ("send", 0, "sB1.0")]]
    hang = simulate(both_recv_first, grid)
    assert hang is not None and "rank 0" in hang and "rank 1" in hang and "recv" in hang
    fixed = [[("send", 1, "sF0.0"), ("recv", 1, "rB0.0")],
             [("recv", 0, "rF1.0"), ("send", 0, "sB1.0")]]
    assert simulate(fixed, grid) is None


@pytest.mark.timeout(60)
def test_simulation_finds_a_collective_one_member_never_reaches():
    cfg, plan = PRESETS["tiny"], Plan(tp=2, dp=2, micro_batches=1, global_batch=2, seq_len=8)
    progs, grid = record_programs(cfg, plan)  # tp groups [0,1] [2,3], dp groups [0,2] [1,3]
    assert simulate(progs, grid) is None
    progs[3] = [e for e in progs[3] if e[2][1][0] != "dp"]  # rank 3 skips its dp collectives
    hang = simulate(progs, grid)
    assert "rank 1" in hang and "dp group [1, 3]" in hang


def test_an_async_op_blocks_only_at_its_wait():
    """Under gloo's rules rank 0 may post its receive asynchronously, send, then wait: no deadlock;
    waiting on the receive before sending is one. Under NCCL's the early receive heads the pair's
    stream, and rank 1's matching send is queued behind its own receive: a deadlock too."""
    grid = Grid(1, 2, 1)
    recv0, send0 = ("recv", 1, "rB0.0"), ("send", 1, "sF0.0")
    early = [("issue", 0, recv0), ("issue", 1, send0), ("wait", 1, send0), ("wait", 0, recv0)]
    peer = [("recv", 0, "rF1.0"), ("send", 0, "sB1.0")]
    assert simulate([early, peer], grid, rules="gloo") is None
    assert "queued behind" in simulate([early, peer], grid)
    blocked = [("issue", 0, recv0), ("wait", 0, recv0), ("issue", 1, send0), ("wait", 1, send0)]
    assert "rank 0" in simulate([blocked, peer], grid, rules="gloo")


def test_fault_parsing_and_validation():
    assert parse_fault("skip:1:2:dp") == Fault("skip", 1, 2, "dp")
    assert parse_fault("slow:0:1:2.5").arg == "2.5"
    for bad in ("boom:1:2", "skip:x:2", "skip:1", "slow:0:1:fast", "crash:-1:0"):
        with pytest.raises(ValueError):
            parse_fault(bad)
    assert parse_size("4MiB") == 4 * 2**20 and parse_size("2GB") == 2e9 and parse_size("1e3") == 1000
    with pytest.raises(ValueError):
        parse_size("lots")
    probs = fault_problems(parse_fault("crash:4:9"), Plan(dp=2), steps=5)
    assert any("rank 4 does not exist" in p for p in probs)
    assert any("step 9 is never reached" in p for p in probs)


def test_oom_report_lists_measured_and_estimated_per_category():
    measured = {"params": 2**20, "grads": 2**20, "optimizer": 2**21, "activations": 0}
    estimated = {"params": 2**20, "grads": 2**20, "optimizer": 2**21, "activations": 3 * 2**20,
                 "comm_buffers": 0}
    text = oom_report(5, {"tp": 1, "pp": 1, "dp": 0}, measured, estimated, 2**22, "activations",
                      3 * 2**20, fits=["tp=2 pp=2 dp=2 --micro-batches 8"])
    assert text.startswith("OUT OF MEMORY on rank 5 (tp=1, pp=1, dp=0)")
    row = next(line for line in text.splitlines() if line.strip().startswith("activations"))
    assert "3.0 MiB" in row and "<- this allocation" in row
    assert "plans that would fit: tp=2 pp=2 dp=2 --micro-batches 8" in text


def test_explain_hang_cli_exit_codes(tmp_path, capsys):
    assert main(["explain-hang", str(tmp_path)]) == 2
    assert "no rank*.json dumps" in capsys.readouterr().err
    grid = {"tp": 1, "pp": 1, "dp": 1, "order": "tp-dp-pp", "world_size": 1}
    dump = {"rank": 0, "status": "finished", "reason": "", "coords": {"tp": 0, "pp": 0, "dp": 0},
            "grid": grid, "context": {}, "blocked": None, "pending": [], "events": [], "seq": {}}
    (tmp_path / "rank0.json").write_text(json.dumps(dump))
    assert main(["explain-hang", str(tmp_path)]) == 0
    assert "no hang" in capsys.readouterr().out


def test_a_reused_run_dir_is_cleared_so_a_stale_abort_marker_cannot_stop_the_next_job(tmp_path):
    from mini3d.launch.launcher import ABORT_MARKER, _clear_run_dir

    for name in (ABORT_MARKER, "launcher.json", "rank0.json", "rank1.stack", "notes.txt"):
        (tmp_path / name).write_text("{}")
    _clear_run_dir(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
