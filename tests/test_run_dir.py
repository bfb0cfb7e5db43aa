"""Each job owns its run directory: a job failing in a run directory that a healthy job shares
does not stop the healthy one (each job's abort marker carries its job id), a stale marker does
not stop a new job, and a job without --run-dir removes its temporary run directory on success."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time

import pytest

from mini3d.cli import main
from tests.test_diag_faults import _children
from tests.test_orphans import REPO

SMALL = ["--hidden", "32", "--global-batch", "4", "--seq-len", "16", "--no-progress"]


@pytest.mark.timeout(180)
def test_a_failing_job_does_not_stop_another_sharing_its_run_dir(tmp_path, capfd):
    run = tmp_path / "run"
    run.mkdir()
    (run / "ABORT").write_text('{"by": "launcher", "reason": "a stale marker"}')  # a failed job's
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    healthy = subprocess.Popen([sys.executable, "-m", "mini3d", "train", *SMALL, "--steps", "40",
                                "--run-dir", str(run), "--log-jsonl", str(tmp_path / "ok.jsonl")],
                               env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        while not (tmp_path / "ok.jsonl").exists() or not (tmp_path / "ok.jsonl").read_text():
            assert healthy.poll() is None, healthy.stdout.read()  # it is training: now fail next to it
            time.sleep(0.1)
        rc = main(["train", *SMALL, "--dp", "2", "--steps", "3", "--run-dir", str(run),
                   "--inject-fault", "crash:1:1", "--hang-timeout", "3", "--timeout", "90"])
        assert rc in (1, 3)  # the crash, or (machine loaded) the hang it causes
        out = healthy.communicate(timeout=150)[0]
    finally:
        if healthy.poll() is None:
            healthy.kill()
            healthy.wait(10)
    assert healthy.returncode == 0, out
    assert "done: 40 steps" in out
    assert _children() == []


@pytest.mark.timeout(120)
def test_a_default_run_dir_is_removed_when_the_job_succeeds(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes the default
    assert main(["train", *SMALL, "--steps", "1"]) == 0
    assert glob.glob(str(tmp_path / "mini3d-run-*")) == []


def test_a_killed_launchers_default_run_dir_is_swept_unless_it_holds_a_post_mortem(tmp_path,
                                                                                   monkeypatch, capsys):
    """The next start removes a default run directory whose launcher is gone (SIGKILLed: it could
    not remove it) and that holds no post-mortem; one with a failed job's record is kept and named
    once; a live launcher's, and one without an owner record (torchrun's, a reported failure's),
    are left alone. tests/test_orphans.py makes such a directory by SIGKILLing a real launcher."""
    from mini3d.diagnose import run_dir as rd
    from mini3d.launch import rdzv

    def made(name, owner, failed=False):
        d = tmp_path / f"{rd.DEFAULT_PREFIX}{name}"
        (d / "job-1").mkdir(parents=True)
        (d / "job-1" / "rank0.ops0").write_text("")  # a black box: evidence, not a post-mortem
        if owner:
            (d / rdzv.OWNER).write_text(owner)
        if failed:
            (d / "job-1" / "launcher.json").write_text('{"ranks": []}')
        return d

    dead = "999999999 0"  # above the kernel's pid_max: an owner that is gone
    gone, kept = made("gone", dead), made("kept", dead, failed=True)
    live = made("live", f"{os.getpid()} {rdzv._start_time(os.getpid())}")
    ownerless = made("ownerless", None)
    assert rd.sweep_default(str(tmp_path)) == [str(gone)]
    err = capsys.readouterr().err
    assert err.count("mini3d: kept") == 1 and f"kept {kept}:" in err and f"explain-hang {kept}" in err
    assert kept.exists() and live.exists() and ownerless.exists()
    assert rd.sweep_default(str(tmp_path)) == [] and capsys.readouterr().err == ""  # named once
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (live / rdzv.OWNER).write_text(dead)
    new = rd.make_default()  # what `mini3d train` without --run-dir calls: sweeps first
    assert not live.exists() and rdzv.owner_alive(new) and os.path.exists(os.path.join(new, rdzv.OWNER))
    rd.release(new)  # a launcher that reported a failure gives the directory to the user
    assert not os.path.exists(os.path.join(new, rdzv.OWNER))
    assert rd.sweep_default(str(tmp_path)) == [] and os.path.isdir(new)


def test_job_ids_made_in_the_same_second_sort_oldest_first():
    """A job that fails at once and its rerun start within one second (a forked launch takes
    0.1 s): run_dir.jobs and explain-hang's "latest failed job" read their ids' order as time."""
    from mini3d.launch.jobs import new_job

    ids = []
    for _ in range(50):
        ids.append(new_job())
        time.sleep(0.0005)
    assert len({i[:15] for i in ids}) <= 2  # mostly one second, as two quick jobs are
    assert sorted(ids) == ids and len(set(ids)) == len(ids)


@pytest.mark.timeout(180)
def test_a_failed_jobs_post_mortem_survives_a_second_job_in_its_run_dir(tmp_path, capsys):
    """Two jobs, one --run-dir: the first fails (rank 1 crashes), the second succeeds afterwards.
    Each has its own RUN_DIR/job-<id>; explain-hang RUN_DIR lists both and explains the failed one
    (it used to say "no hang: every rank finished", the second job having cleared the dumps)."""
    run = tmp_path / "run"
    rc = main(["train", *SMALL, "--dp", "2", "--steps", "3", "--run-dir", str(run),
               "--inject-fault", "crash:1:1", "--hang-timeout", "3", "--timeout", "90"])
    assert rc in (1, 3)
    assert main(["train", *SMALL, "--steps", "1", "--run-dir", str(run)]) == 0
    jobs = sorted(glob.glob(str(run / "job-*")))
    assert len(jobs) == 2, jobs
    failed, ok = jobs
    assert {"launcher.json", "rank0.json"} <= set(os.listdir(failed))  # the first job's, intact
    capsys.readouterr()
    assert main(["explain-hang", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"{os.path.basename(failed)}: failed   <- explained below" in out, out
    assert f"{os.path.basename(ok)}: finished" in out, out
    assert "culprit: rank 1 (tp=0, pp=0, dp=1) crashed" in out, out
    assert "no hang" not in out
    assert main(["explain-hang", ok]) == 0  # a job's own directory is explained as itself
    assert "no hang: every rank finished" in capsys.readouterr().out
    assert _children() == []
