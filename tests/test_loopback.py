"""A local job opens no network listener beyond loopback (the system's socket table, as `ss -ltn`
shows it, read from /proc/net/tcp{,6}), while it runs: ranks meet through a FileStore in a private
directory, and gloo's own sockets are pinned to the loopback interface."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.test_orphans import REPO, kill_all, marked

LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def listeners(pids: list[int]) -> list[str]:
    """'ADDR:PORT' (hex, as /proc/net/tcp writes them) of every TCP socket in LISTEN state that one
    of `pids` holds."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    out.append(cols[1])
    return out


@pytest.mark.timeout(120)
def test_a_local_job_listens_on_loopback_only(tmp_path):
    value = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MINI3D_TEST_LISTEN=value)
    marker = f"MINI3D_TEST_LISTEN={value}".encode()
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "mini3d", "train", "--dp", "2", "--global-batch", "4", "--steps",
           "500", "--no-progress", "--run-dir", str(run)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    seen = []
    try:
        deadline = time.monotonic() + 90
        while not any(all((job / f"rank{r}.stack").exists() for r in (0, 1))  # both watchdogs up
                      for job in run.glob("job-*")):  # (in the job's own RUN_DIR/job-<id>):
            assert proc.poll() is None and time.monotonic() < deadline   # past the rendezvous
            time.sleep(0.1)
        for _ in range(10):  # while it trains
            seen += listeners(marked(marker))
            time.sleep(0.2)
        assert proc.poll() is None, "the job ended before the sockets could be read"
    finally:
        proc.kill()
        proc.wait(10)
        time.sleep(0.5)
        kill_all(marked(marker))
    assert seen, "no listener seen at all: the test would not see a wrong one either"
    wide = sorted({a for a in seen if a.split(":")[0] not in LOOPBACK})
    assert not wide, f"listening beyond loopback: {wide}"
