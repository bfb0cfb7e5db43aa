"""Ctrl-C and SIGTERM stop every rank at the same step boundary, after a checkpoint when --save is
given, with one line and exit 130 / 143; a resume that would change the batches (seed, data,
global batch) is refused unless --allow-change; a non-finite loss stops the job with exit 5."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from mini3d import cli
from mini3d.checkpoint.store import latest_dir, read_meta
from mini3d.checkpoint.verify import verify_checkpoint
from tests.test_orphans import REPO, kill_all, marked

SMALL = ["--hidden", "32", "--global-batch", "4", "--seq-len", "16", "--no-progress"]


def _interrupt(tmp_path, send, extra=()) -> tuple[int, str, int]:
    """Start a dp2 job saving to tmp_path/ck, `send(proc)` once it has logged 2 steps;
    (exit status, its output, steps logged)."""
    value = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MINI3D_TEST_SIGNAL=value)
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "mini3d", "train", *SMALL, "--dp", "2", "--steps", "500",
           "--save", str(tmp_path / "ck"), "--log-jsonl", str(log), *extra]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        send(proc)
        out = proc.communicate(timeout=60)[0]
    finally:
        _reap(proc, value)
    return proc.returncode, out, len(log.read_text().splitlines())


def _reap(proc, value: str):
    """Kill the job if it is still running, then fail if any rank it started (marked by the job's
    MINI3D_TEST_SIGNAL value) survived it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    time.sleep(0.3)
    left = marked(f"MINI3D_TEST_SIGNAL={value}".encode())
    kill_all(left)
    assert not left, "a rank survived"


@pytest.mark.timeout(150)
def test_sigterm_saves_at_a_step_boundary_and_exits_143(tmp_path, capsys, monkeypatch):
    code, out, logged = _interrupt(tmp_path, lambda p: p.send_signal(signal.SIGTERM))
    assert code == 143, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mini3d train: stopped by SIGTERM after step"), out
    root = str(tmp_path / "ck")
    step = read_meta(latest_dir(root))["step"]
    assert lines[0].endswith(f"checkpoint {root}/step-{step:06d} saved") and step == logged
    assert verify_checkpoint(latest_dir(root)) == []

    # a resume that changes what the batches are is refused, or warned about with --allow-change
    def tripwire(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(cli, "launch_train", tripwire)
    resume = ["train", *SMALL, "--dp", "2", "--steps", "600", "--resume", root]
    for flags, needle in ((["--seed", "9"], "--seed 9 differs from the checkpoint's seed 0"),
                          (["--global-batch", "8"], "--global-batch 8 differs from the checkpoint's 4"),
                          (["--data", __file__], "differs from the checkpoint's data 'the embedded")):
        assert cli.main([*resume, *flags]) == 2
        err = capsys.readouterr().err
        assert needle in err and "--allow-change" in err, err
    with pytest.raises(AssertionError, match="a process was started"):
        cli.main([*resume, "--seed", "9", "--allow-change"])
    assert "warning: --seed 9 differs" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="a process was started"):
        cli.main(resume)  # nothing changed: accepted without a word


@pytest.mark.timeout(150)
def test_ctrl_c_stops_every_rank_cleanly_with_exit_130(tmp_path):
    # Ctrl-C: the terminal sends SIGINT to the whole foreground process group
    code, out, logged = _interrupt(tmp_path, lambda p: os.killpg(p.pid, signal.SIGINT))
    assert code == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "leaked" not in out, out
    assert out.strip().startswith("mini3d train: stopped by SIGINT after step"), out
    assert read_meta(latest_dir(str(tmp_path / "ck")))["step"] == logged


@pytest.mark.timeout(120)
def test_a_non_finite_loss_stops_the_job_with_exit_5(tmp_path, capfd):
    log = tmp_path / "log.jsonl"
    code = cli.main(["train", *SMALL, "--lr", "1e30", "--steps", "6", "--log-jsonl", str(log)])
    err = capfd.readouterr().err
    assert code == 5, err
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert err.startswith(f"mini3d train: the loss is nan at step {len(losses) + 1} (seen on rank 0"), err


def _ranks_started(pid: int) -> bool:
    """Whether the launcher `pid` has started a rank: a process forked by its forkserver (a child of
    `pid` running multiprocessing's forkserver, mini3d.launch.zygote), or a spawned child."""
    procs = {}
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{child}/cmdline", "rb") as f:
                procs[int(child)] = (ppid, f.read())
        except (OSError, ValueError, IndexError):
            continue
    servers = {c for c, (ppid, cmd) in procs.items() if ppid == pid and b"forkserver" in cmd}
    return any(ppid in servers or (ppid == pid and b"spawn_main" in cmd)
               for ppid, cmd in procs.values())


def _stop_while_starting(tmp_path, signum: int, delay: float) -> tuple[int, str]:
    """A dp2 job saving to tmp_path/ck, sent `signum` `delay` s after its first rank was spawned
    (while the ranks import torch, before their stop handler exists); (exit status, output)."""
    value = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MINI3D_TEST_SIGNAL=value)
    cmd = [sys.executable, "-m", "mini3d", "train", *SMALL, "--dp", "2", "--steps", "500",
           "--save", str(tmp_path / "ck")]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not _ranks_started(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.01)
        time.sleep(delay)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        else:
            proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    finally:
        _reap(proc, value)
    return proc.returncode, out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("signum,delay", [(signal.SIGTERM, 0.0), (signal.SIGTERM, 0.3),
                                          (signal.SIGTERM, 1.0), (signal.SIGINT, 0.0),
                                          (signal.SIGINT, 0.5)])
def test_a_stop_while_the_ranks_start_is_the_signals_exit_blaming_no_rank(tmp_path, signum,
                                                                          delay):
    """Before, the forwarded stop (SIGUSR1) or Ctrl-C met a rank without its handler: killed, or a
    KeyboardInterrupt, and the job was exit 1 blaming rank 0. Now the ranks start with the stop
    signals blocked: the stop lands when the handler is installed (one step, its checkpoint)."""
    code, out = _stop_while_starting(tmp_path, signum, delay)
    name = signal.Signals(signum).name
    assert code == 128 + signum, out
    assert out.strip().startswith(f"mini3d train: stopped by {name}"), out
    assert not re.search(r"\brank \d", out) and "Traceback" not in out, out  # no rank blamed
    if "after step" in out:  # it stopped at the first boundary, after saving there
        assert verify_checkpoint(latest_dir(str(tmp_path / "ck"))) == []


@pytest.mark.timeout(150)
def test_interrupted_twice_names_the_checkpoint_that_was_written(tmp_path):
    def twice(proc):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)

    # a checkpoint every step: after 2 logged steps this run has written complete ones
    code, out, _ = _interrupt(tmp_path, twice, ["--save-every", "1"])
    assert code == 130, out
    ckpt = latest_dir(str(tmp_path / "ck"))
    assert ckpt is not None and verify_checkpoint(ckpt) == []
    if "interrupted twice" in out:  # (else the stop finished between the two: the usual line)
        assert "without a checkpoint" not in out, out
        assert f"the last complete checkpoint is {ckpt}" in out, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_python_imports_torch_is_the_signals_exit(signum):
    """Before `mini3d train` installs its handlers (Python still importing torch) a signal used to
    kill the process outright (-15) or print a KeyboardInterrupt traceback (the campaign's finding);
    now 143 / 130 and one line."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "mini3d", "train", "--steps", "5"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.5)  # inside `import torch` (seconds, more on a busy host)
    proc.send_signal(signum)
    out = proc.communicate(timeout=50)[0]
    assert proc.returncode == 128 + signum, out
    assert "Traceback" not in out and out.strip().startswith("mini3d: stopped by"), out
