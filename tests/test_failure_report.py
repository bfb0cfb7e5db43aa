"""The first line of a failed `mini3d train` names the rank that caused it (not a victim), its grid
coordinates, the step and the cause; the victims come after; library noise (gloo's `terminate
called ...`) is not on the terminal but in the run directory. Each case is one 2-rank dp2 ZeRO-3
job (the layout where explain-hang used to blame the wrong rank for skip and shape); the tp2 x pp2
cases are checked in tests/test_faults_trainer.py."""

import time

import pytest

from mini3d.cli import main
from mini3d.diagnose.explain import explain
from tests.test_diag_faults import _children

ZERO3 = ["--dp", "2", "--zero", "3", "--global-batch", "4", "--steps", "3", "--no-progress",
         "--hang-timeout", "3", "--timeout", "90"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault,rc_want,kind,first", [
    ("skip:1:2", (1, 3), "skip", "rank 1 (tp=0, pp=0, dp=1) skipped a collective"),
    ("shape:1:2", (1, 3), "shape", "rank 1 (tp=0, pp=0, dp=1) entered a collective with the wrong "
                                   "tensor shape in step 2"),
    ("freeze:1:1", (3,), "stopped", "rank 1 (tp=0, pp=0, dp=1) stopped responding (its process was "
                                    "frozen"),
    ("raise:1:1", (1,), "error", "rank 1 (tp=0, pp=0, dp=1) crashed with RuntimeError: injected "
                                 "fault raise:1:1"),
])
def test_the_first_line_names_the_culprit(tmp_path, capfd, fault, rc_want, kind, first):
    run = tmp_path / "run"
    t0 = time.monotonic()
    rc = main(["train", *ZERO3, "--run-dir", str(run), "--inject-fault", fault])
    seconds = time.monotonic() - t0
    err = capfd.readouterr().err
    assert rc in rc_want, err
    assert _children() == [], "a rank survived the job"
    assert seconds < 3 + 30 + 30
    lines = err.strip().splitlines()
    assert lines[0].startswith("mini3d train: " + first), err
    assert "step" in lines[0] and "the other ranks stopped because of it: rank 0" in lines[1], err
    assert "terminate called" not in err and "Traceback" not in err.split("---")[0], err
    assert "in step 1 in step 1" not in err and "in step 2 in step 2" not in err, err
    ex = explain(str(run))
    assert (ex.culprit, ex.kind) == (1, kind), ex.text


@pytest.mark.timeout(120)
def test_a_frozen_rank_costs_only_the_hang_timeout(tmp_path):
    """A rank stopped by SIGSTOP can never dump, so the launcher must not wait its dump grace for it
    (it did: hang-timeout + 8-21 s). Measured from the op its peer waited in (its dump's wall time
    less the op's age) to the end of `mini3d train`: under hang-timeout + 6 s, a generous bound
    (the launcher's own grace is 5 s); start-up is not counted."""
    import json
    import glob

    run = tmp_path / "run"
    hang = 3.0
    rc = main(["train", *ZERO3, "--run-dir", str(run), "--inject-fault", "freeze:1:1"])
    end = time.time()
    assert rc == 3
    assert _children() == [], "a rank survived the job"
    dump, = glob.glob(str(run / "job-*" / "rank0.json"))
    with open(dump) as f:
        d = json.load(f)
    began = d["time"] - d["blocked"]["age_s"]
    assert end - began < hang + 6, (end - began, d["status"])
