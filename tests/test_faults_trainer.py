"""Each injected fault in a real `mini3d train` job on a small 3D layout (tp=2 x pp=2): the job ends
within hang-timeout + 30 s with a non-zero status, no process survives, and `explain-hang` names
the culprit rank and the operation (`slow` must instead finish with the fault-free losses).
The drills of tests/test_diag_faults.py cover the same kinds on the bare communication pattern."""

import json
import time

import pytest

from mini3d.cli import main
from mini3d.diagnose.explain import explain
from tests.test_diag_faults import _children

HANG_TIMEOUT = 3.0
LAYOUT = ["--tp", "2", "--pp", "2", "--micro-batches", "2", "--global-batch", "4", "--steps", "3",
          "--no-progress", "--hang-timeout", str(HANG_TIMEOUT), "--timeout", "120"]


def _train(tmp_path, *extra):
    t0 = time.monotonic()
    rc = main(["train", *LAYOUT, "--run-dir", str(tmp_path / "run"), *extra])
    return rc, time.monotonic() - t0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault,rc_want,culprit,kind,needle,first", [
    ("crash:1:1", (1, 3), 1, "crash", "rank 1 (tp=1, pp=0, dp=0) crashed",
     "rank 1 (tp=1, pp=0, dp=0) was killed by signal 9 (SIGKILL) in step 1"),
    ("skip:1:1", (3,), 1, "skip", "rank 1 skipped one all_reduce on this group",
     "rank 1 (tp=1, pp=0, dp=0) skipped a collective"),
    ("shape:2:1", (1, 3), 2, "shape", "rank 2 sent shape",
     "rank 2 (tp=0, pp=1, dp=0) entered a collective with the wrong tensor shape in step 1"),
    ("p2p-order:0:1", (3,), 0, "p2p-order", "point-to-point",
     "rank 0 (tp=0, pp=0, dp=0) is in a point-to-point order deadlock"),
])
def test_fault_in_a_3d_training_job_is_explained(tmp_path, capfd, fault, rc_want, culprit, kind,
                                                 needle, first):
    rc, seconds = _train(tmp_path, "--inject-fault", fault)
    err = capfd.readouterr().err
    assert rc in rc_want, (fault, rc)  # shape: gloo's abort (1) or, on a loaded machine, the hang (3)
    # the culprit first (not a victim's "Connection closed by peer", not gloo's abort text)
    assert err.splitlines()[0].startswith("mini3d train: " + first), err
    assert "the other ranks stopped because of it" in err.splitlines()[1], err
    assert "terminate called" not in err, err
    assert seconds < HANG_TIMEOUT + 30 + 30  # + 30 s to start 4 processes on 2 busy cores
    assert _children() == [], "a rank survived the job"
    ex = explain(str(tmp_path / "run"))
    assert (ex.culprit, ex.kind) == (culprit, kind), ex.text
    assert needle in ex.text, ex.text


TWO = ["--hidden", "32", "--global-batch", "4", "--seq-len", "16", "--steps", "3", "--no-progress",
       "--hang-timeout", str(HANG_TIMEOUT), "--timeout", "120"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout,fault,first", [
    # --cp 2 used to refuse skip and shape ("a single process issues no collective")
    (["--cp", "2"], "skip:1:1", "rank 1 (tp=0, cp=1, pp=0, dp=0) skipped a collective"),
    (["--cp", "2"], "shape:1:1", "rank 1 (tp=0, cp=1, pp=0, dp=0) sent a point-to-point message "
                                 "with the wrong tensor shape in step 1"),
    # the case: exit 0 and clean losses (the extra row went into a broadcast's receiver)
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "2"],
     "shape:0:1", "rank 0 (tp=0, pp=0, dp=0) sent a point-to-point message with the wrong tensor "
                  "shape in step 1"),
    # a skip gloo answers with SIGABRT (the skipper leaves no dump: its black box tells)
    (["--tp", "2"], "skip:1:1", "rank 1 (tp=1, pp=0, dp=0) skipped a collective"),
    # a skip that ends in a cycle of two collectives (was named a point-to-point order deadlock)
    (["--dp", "2", "--zero", "2"], "skip:1:1", "rank 1 (tp=0, pp=0, dp=1) skipped a collective"),
    # the step's last op (the loss broadcast): the skipper waits at the step's boundary, not in an
    # op (was "stopped responding"); its black box's end-of-step line makes the step whole
    (["--pp", "2", "--micro-batches", "2"], "skip:0:1",
     "rank 0 (tp=0, pp=0, dp=0) skipped a collective its group's other members entered in step 1"),
])
def test_skip_and_shape_are_named_on_two_rank_layouts(tmp_path, capfd, layout, fault, first):
    rc = main(["train", *TWO, *layout, "--run-dir", str(tmp_path / "run"), "--inject-fault", fault])
    err = capfd.readouterr().err
    assert rc in (1, 3), (rc, err)
    assert err.splitlines()[0].startswith("mini3d train: " + first), err
    assert "Traceback" not in err and "terminate called" not in err, err
    assert _children() == [], "a rank survived the job"


@pytest.mark.timeout(150)
def test_a_straggler_only_makes_the_job_later(tmp_path):
    logs = {}
    for name, extra in (("clean", []), ("slow", ["--inject-fault", "slow:3:1:2"])):
        log = tmp_path / f"{name}.jsonl"
        rc, seconds = _train(tmp_path / name, "--log-jsonl", str(log), *extra)
        assert rc == 0
        logs[name] = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["loss"] for r in logs["slow"]] == [r["loss"] for r in logs["clean"]]
    assert logs["slow"][1]["step_time_s"] > 2.0  # step 2 (index 1) waited for the 2 s nap
    assert _children() == []



@pytest.mark.timeout(150)
def test_hang_is_seen_when_waits_return_before_completion(tmp_path, monkeypatch):
    """NCCL-like completion (MINI3D_DEFERRED_WAIT=1): mini3d's waits return before the op completes
    and the host blocks afterwards, outside them. dp=2, rank 1 stalls for 120 s at step 2 (outside
    communication), so rank 0 blocks on its gradient all-reduce. The watchdog follows each op's Work
    to completion and ends the job within hang-timeout + 30 s, and explain-hang names rank 1.
    (With the old rule, the event ended when wait() returned: nothing pending, no dump, and the job
    ran until its --timeout; checked by hand.)"""
    monkeypatch.setenv("MINI3D_DEFERRED_WAIT", "1")
    hang = 6.0
    t0 = time.monotonic()
    rc = main(["train", "--dp", "2", "--global-batch", "4", "--steps", "3", "--no-progress",
               "--hang-timeout", str(hang), "--timeout", "120", "--run-dir", str(tmp_path / "run"),
               "--inject-fault", "slow:1:1:120"])
    seconds = time.monotonic() - t0
    assert rc == 3
    assert seconds < hang + 30 + 30  # + 30 s to start the processes on 2 busy cores
    assert _children() == [], "a rank survived the job"
    ex = explain(str(tmp_path / "run"))
    assert (ex.culprit, ex.kind) == (1, "straggler"), ex.text
    assert "all_reduce #3 on the dp group [0, 1]" in ex.text, ex.text
