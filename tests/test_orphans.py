"""No orphan in any window: `kill -9` of the launcher at many moments of a job's start-up (before,
during and after the workers import torch and rendezvous) leaves no worker running.

Every process the test starts carries a marker in its environment (inherited by the workers), so
survivors are found in /proc whoever their parent has become; the `finally` kills any by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOMENTS = (0.5, 1.2, 2.0, 3.0, 4.5, 7.0)  # seconds after the launcher started


def marked(marker: bytes) -> list[int]:
    """Live (non-zombie) processes whose environment holds `marker`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(150)
def test_killing_the_launcher_during_start_up_leaves_no_worker(tmp_path):
    value = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MINI3D_TEST_ORPHAN=value)
    marker = f"MINI3D_TEST_ORPHAN={value}".encode()
    survivors = {}
    try:
        for i, moment in enumerate(MOMENTS):
            cmd = [sys.executable, "-m", "mini3d", "train", "--dp", "2", "--global-batch", "4",
                   "--steps", "200", "--no-progress", "--run-dir", str(tmp_path / f"run{i}")]
            proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            time.sleep(moment)
            proc.kill()  # the launcher only: its workers must follow by themselves
            proc.wait(10)
            deadline = time.monotonic() + 10
            while marked(marker) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = marked(marker)
            if left:
                survivors[moment] = left
                kill_all(left)
    finally:
        kill_all(marked(marker))
    assert not survivors, f"workers survived the launcher killed at these moments (s): {survivors}"
