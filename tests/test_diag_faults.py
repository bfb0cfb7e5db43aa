"""Fault drills: each injected fault ends the job in time, leaves no process, and is explained.

These drive the faults through `mini3d.diagnose.drill` (the communication pattern of a tp x pp x dp
step through mini3d.comm, with the same `diagnostics(topo, spec)` hooks the trainer calls), whose
values are exact; tests/test_faults_trainer.py does the same through real `mini3d train` jobs.
Each test is ONE launch of 2 ranks (dp=2, or pp=2 for p2p-order) to stay lean on 2 busy cores.
"""

import os
import time

import pytest

from mini3d.cli import main
from mini3d.diagnose.drill import drill_worker, expected_sums
from mini3d.diagnose.explain import explain
from mini3d.launch.launcher import HangDetected, LaunchTimeout, WorkerError, launch

HANG_TIMEOUT = 3.0  # seconds an op may be pending before the watchdog calls it a hang
SLACK = 30.0  # the brief: a faulty job ends within hang_timeout + 30 s (spawn time excluded)


def _children() -> list[int]:
    """Live (non-zombie) ranks of this test process: its children, and the children of the
    forkserver the ranks are forked from (mini3d.launch.zygote: the server itself, like
    multiprocessing's resource tracker, lives as long as this process and is not counted)."""
    procs = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline") as f:
                procs[int(pid)] = (int(fields[1]), fields[0], f.read())
        except OSError:
            continue
    servers = {p for p, (ppid, _, cmd) in procs.items() if ppid == os.getpid() and "forkserver" in cmd}
    return [p for p, (ppid, state, cmd) in procs.items()
            if (ppid == os.getpid() or ppid in servers) and state != "Z" and p not in servers
            and "resource_tracker" not in cmd]


def _drill(tmp_path, fault, dp=2, pp=1, tp=1):
    """Run the drill with `fault`; returns (outcome or exception, seconds, explanation, spec)."""
    spec = dict(tp=tp, pp=pp, dp=dp, steps=3, micro_batches=2, run_dir=str(tmp_path / "run"),
                hang_timeout=HANG_TIMEOUT, inject_fault=fault)
    t0 = time.monotonic()
    try:
        outcome = launch(drill_worker, tp * pp * dp, spec, timeout=90, run_dir=spec["run_dir"])
    except (WorkerError, LaunchTimeout) as e:
        outcome = e
    seconds = time.monotonic() - t0
    assert _children() == [], "a rank survived the job"
    return outcome, seconds, explain(spec["run_dir"]), spec


@pytest.mark.timeout(120)
def test_crash_is_blamed_on_the_dead_rank(tmp_path):
    outcome, seconds, ex, _ = _drill(tmp_path, "crash:1:1")
    assert isinstance(outcome, WorkerError) and seconds < HANG_TIMEOUT + SLACK
    assert (ex.culprit, ex.kind) == (1, "crash")
    assert "rank 1 was killed by SIGKILL" in ex.text
    assert "all_reduce #2 on the dp group [0, 1]" in ex.text  # what rank 0 waited in, step 1


@pytest.mark.timeout(120)
def test_skipped_collective_is_found_by_aligning_sequence_numbers(tmp_path):
    # tp=2 x dp=2: rank 1 skips its dp all-reduce of step 1; ranks 0 and 2 are in other groups
    outcome, seconds, ex, _ = _drill(tmp_path, "skip:1:1:dp", tp=2, dp=2)
    assert isinstance(outcome, (WorkerError, HangDetected)) and seconds < HANG_TIMEOUT + SLACK
    assert (ex.culprit, ex.kind) == (1, "skip")
    assert "rank 3 (tp=1, pp=0, dp=1)" in ex.text and "on the dp group [1, 3]" in ex.text
    assert "rank 1 never entered it" in ex.text
    assert "rank 1 skipped one all_reduce on this group at step 1" in ex.text


@pytest.mark.timeout(120)
def test_shape_mismatch_names_the_rank_and_both_shapes(tmp_path):
    outcome, seconds, ex, _ = _drill(tmp_path, "shape:1:1")
    assert isinstance(outcome, WorkerError) and seconds < HANG_TIMEOUT + SLACK
    assert (ex.culprit, ex.kind) == (1, "shape")
    assert "rank 1 sent shape (3, 4)" in ex.text and "(2, 4)" in ex.text  # ACT is (2, 4)
    assert "all_reduce #2" in ex.text


@pytest.mark.timeout(120)
def test_p2p_order_deadlock_is_a_real_hang_caught_by_the_watchdog(tmp_path):
    outcome, seconds, ex, spec = _drill(tmp_path, "p2p-order:0:1", dp=1, pp=2)
    assert isinstance(outcome, HangDetected) and outcome.rank in (0, 1)
    assert HANG_TIMEOUT < seconds < HANG_TIMEOUT + SLACK
    run = tmp_path / "run"
    assert (run / "rank0.json").exists() and (run / "rank1.json").exists()  # both dumped
    assert (ex.culprit, ex.kind) == (0, "p2p-order")
    assert "rank 0 and rank 1 both wait in recv from each other" in ex.text
    assert "rank 0 posted its recv before its send" in ex.text


@pytest.mark.timeout(120)
def test_slow_rank_finishes_correctly_only_later(tmp_path):
    outcome, seconds, ex, spec = _drill(tmp_path, "slow:1:1:1.5")
    assert isinstance(outcome, list), outcome  # no failure
    for r in outcome:  # exact: the drill's values are small integers, no rounding anywhere
        assert r["sums"] == expected_sums(spec, 2)
    # rank 0 waited for the straggler in one op for most of its 1.5 s nap (less scheduling noise)
    assert outcome[0]["max_wait_s"] > 1.0
    assert ex.kind == "finished" and "no hang" in ex.text


@pytest.mark.timeout(120)
def test_oom_through_the_trainer_names_rank_and_category(tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["train", "--steps", "3", "--no-progress", "--run-dir", str(run),
               "--inject-fault", "oom:0:1", "--memory-budget", "64MiB", "--timeout", "90"])
    err = capsys.readouterr().err
    assert rc == 4  # the OOM exit code
    assert "OUT OF MEMORY on rank 0 (tp=0, pp=0, dp=0)" in err and "activations" in err
    assert _children() == []
    ex = explain(str(run))
    assert (ex.culprit, ex.kind) == (0, "oom") and "<- this allocation" in ex.text
