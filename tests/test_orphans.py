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


@pytest.mark.timeout(300)
def test_a_killed_launcher_leaves_no_noise_and_its_rendezvous_dir_is_swept(tmp_path):
    """SIGKILL of a training launcher: its ranks die with it (PDEATHSIG) and print no traceback (no
    EOFError, no resource_tracker warning) on the terminal, and the private rendezvous directory it
    could not remove is removed by the next launch (`rdzv.sweep`), the owner being gone; so is its
    default run directory, which holds no post-mortem."""
    from mini3d.launch import rdzv

    value = uuid.uuid4().hex
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MINI3D_TEST_ORPHAN=value,
               TMPDIR=str(tmp))
    marker = f"MINI3D_TEST_ORPHAN={value}".encode()
    cmd = [sys.executable, "-m", "mini3d", "train", "--dp", "2", "--global-batch", "4", "--steps",
           "500", "--no-progress", "--log-jsonl", str(log)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 200  # (start-up on 2 busy cores)
        while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        assert log.exists() and log.read_text(), "the job never trained"
        stale = [p for p in tmp.iterdir() if p.name.startswith(rdzv.PREFIX)]
        assert len(stale) == 1 and rdzv.owner_alive(str(stale[0]))
        proc.kill()
        err = proc.communicate(timeout=30)[1]
        deadline = time.monotonic() + 10
        while marked(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # what a dying rank or resource tracker prints comes now
        assert not marked(marker)
    finally:
        kill_all(marked(marker))
    assert "Traceback" not in err and "EOFError" not in err and "resource_tracker" not in err, err
    assert not rdzv.owner_alive(str(stale[0]))
    assert rdzv.sweep(str(tmp)) == [str(stale[0])]
    assert not stale[0].exists()
    # its default run directory (no --run-dir): no post-mortem in it (its ranks died with it), so
    # the next start removes it too (mini3d.diagnose.run_dir.sweep_default, called by make_default)
    from mini3d.diagnose.run_dir import DEFAULT_PREFIX, sweep_default

    (run_dir,) = [p for p in tmp.iterdir() if p.name.startswith(DEFAULT_PREFIX)]
    assert not rdzv.owner_alive(str(run_dir))
    assert sweep_default(str(tmp)) == [str(run_dir)] and not run_dir.exists()
