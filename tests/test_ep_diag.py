"""Expert parallelism's diagnostics (issue #30): a wrong all-to-all split size (`--inject-fault
a2a-split`) ends the job in time and is explained with both sizes; the OOM report names the
expert states and the dispatch buffers; `--ep` with `--init-from-hf` and with `--sample-every`."""

import re
import time

import pytest

from mini3d.cli import main
from mini3d.diagnose.explain import explain
from tests.test_diag_faults import _children

HANG_TIMEOUT = 3.0
EP = ["--dp", "2", "--ep", "2", "--experts", "4", "--top-k", "2", "--hidden", "32",
      "--global-batch", "4", "--seq-len", "16", "--no-progress"]


@pytest.mark.timeout(150)
def test_a2a_split_names_the_sender_and_both_sizes(tmp_path, capfd):
    run = tmp_path / "run"
    t0 = time.monotonic()
    rc = main(["train", *EP, "--steps", "3", "--hang-timeout", str(HANG_TIMEOUT), "--timeout",
               "120", "--run-dir", str(run), "--inject-fault", "a2a-split:1:1"])
    seconds = time.monotonic() - t0
    err = capfd.readouterr().err
    assert rc in (1, 3), (rc, err)  # gloo aborts the receiver (1); or the hang watchdog (3)
    assert seconds < HANG_TIMEOUT + 30 + 30  # + 30 s to start 2 processes on 2 busy cores
    assert _children() == [], "a rank survived the job"
    lines = err.strip().splitlines()
    assert lines[0].startswith("mini3d train: rank 1 (tp=0, ep=1, pp=0, dp=1) sent an all-to-all "
                               "block of another size than its peer expected"), err
    assert "in step 1" in lines[0] and "rank 0" in lines[1], err
    assert "terminate called" not in err and "Traceback" not in err, err
    ex = explain(str(run))
    assert (ex.culprit, ex.kind) == (1, "a2a-split"), ex.text
    # the dispatch (token rows), not the count exchange: rank 1 sent rank 0 one row more than the
    # count it announced, which is what rank 0 expected
    m = re.search(r"all_to_all #\d+ on the ep group \[0, 1\] \(step 1, mb 0\): rank 1 sent (\d+) "
                  r"rows to rank 0, which expected (\d+) from it", ex.text)
    assert m and int(m.group(1)) == int(m.group(2)) + 1, ex.text
    assert "a2a-split:1:1" in ex.text and "grid tp=1 ep=2 pp=1 dp=2" in ex.text
