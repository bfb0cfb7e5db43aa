"""Two `mini3d prepare` runs into one --out: the first holds an exclusive flock on the directory
while it writes, the second is exit 2 saying so (before, they shared the `.part` file names, one
crashed with a traceback, and the second took the live first for an interrupted run to resume)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

import pytest

from mini3d import cli

BUSY = "another mini3d prepare is writing there"


def test_a_prepare_into_a_locked_out_is_exit_2_and_writes_nothing(tmp_path, capsys):
    src, out = tmp_path / "a.txt", tmp_path / "out"
    src.write_text("hello world\n" * 200)
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)  # a live prepare's lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert cli.main(["prepare", str(src), "--out", str(out), "--no-progress"]) == 2
        assert BUSY in capsys.readouterr().err
        assert os.listdir(out) == []
    finally:
        os.close(fd)
    assert cli.main(["prepare", str(src), "--out", str(out), "--no-progress"]) == 0  # unlocked


@pytest.mark.timeout(300)
def test_two_live_prepares_into_one_out(tmp_path, capsys):
    """The first in a process of its own, the second in this one (it starts in no time)."""
    src, out = tmp_path / "big.txt", tmp_path / "out"
    src.write_text(("the quick brown fox jumps over the lazy dog " * 20 + "\n") * 9000)  # 8 MB
    cmd = [sys.executable, "-m", "mini3d", "prepare", str(src), "--out", str(out),
           "--shard-tokens", "32768", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    first = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    while not (out / "progress.json").exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.02)  # the first is writing shards now
    code = cli.main(cmd[3:])
    running, err2 = first.poll() is None, capsys.readouterr().err
    err1 = first.communicate(timeout=240)[1]
    assert first.returncode == 0 and "Traceback" not in err1, err1
    assert running, "the first prepare ended before the second ran: make the input bigger"
    assert code == 2 and BUSY in err2, err2
    assert (out / "header.json").exists() and not (out / "progress.json").exists()
