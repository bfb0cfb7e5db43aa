"""A checkpoint save runs on its own clock, not the hang clock (mini3d.diagnose.save_clock): a save
longer than --hang-timeout completes, and a save stuck past its bound is still ended (exit 3) with
a report naming the saving rank. Each job is 2 ranks (dp=2: each writes its share of the sharded
checkpoint, then they meet in the save's barrier); the save is slowed down in the workers by
MINI3D_TEST_PAUSE_IN_SAVE (seconds each writer sleeps after its file,
mini3d.checkpoint.store.CheckpointWriter.write_shares)."""

import os
import re
import time

import pytest

from mini3d.checkpoint.store import latest_dir, read_meta
from mini3d.checkpoint.verify import verify_checkpoint
from mini3d.cli import main
from mini3d.diagnose import save_clock as sc
from mini3d.diagnose.explain import explain
from mini3d.diagnose.flight_recorder import nccl_env
from tests.test_diag_faults import _children

JOB = ["train", "--dp", "2", "--global-batch", "4", "--steps", "2", "--no-progress",
       "--hang-timeout", "4", "--timeout", "120"]


def test_the_bound_grows_with_the_bytes_and_the_process_group_waits_past_it(monkeypatch):
    monkeypatch.delenv(sc.BOUND_ENV, raising=False)
    small, big = sc.save_bound(0, 4.0), sc.save_bound(10 * 2**30, 4.0)
    assert small == 4.0 + sc.SAVE_SLACK_S
    assert big == pytest.approx(small + 10 * 2**30 / sc.SAVE_RATE)  # ~9 min more for 10 GiB
    assert sc.pg_timeout_s(4.0) == 64  # no save: a minute after the hang timeout, as before
    bound = sc.save_bound(10 * 2**30, 4.0)  # a save: a minute after a waiter would report
    assert sc.pg_timeout_s(4.0, 10 * 2**30) == int(bound + sc.waiter_grace(bound)) + 60
    assert nccl_env(4.0, "/r", "gloo", 10 * 2**30)["MINI3D_PG_TIMEOUT_S"] == str(
        sc.pg_timeout_s(4.0, 10 * 2**30))
    monkeypatch.setenv(sc.BOUND_ENV, "2.5")
    assert sc.save_bound(10 * 2**30, 4.0) == 2.5
    clock = sc.SaveClock(start=0.0, bound=10.0, nbytes=1, step=3, writers=(0,))
    assert not clock.overdue(9.0, waiting=False) and clock.overdue(10.5, waiting=False)
    assert not clock.overdue(10.5, waiting=True) and clock.overdue(15.5, waiting=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("extra", [[], ["--async-save", "--save-every", "1"]], ids=["sync", "async"])
def test_a_save_longer_than_the_hang_timeout_completes(tmp_path, monkeypatch, extra):
    # each save takes 12 s after its files: 3x --hang-timeout, not a hang. With --async-save the
    # step-1 write sleeps in the background while step 2 trains (no op of it is watched), and
    # the waits for it (at the step-2 save, at the end) run on the save's clock
    monkeypatch.setenv("MINI3D_TEST_PAUSE_IN_SAVE", "12")
    monkeypatch.delenv(sc.BOUND_ENV, raising=False)
    t0 = time.monotonic()
    rc = main([*JOB, "--save", str(tmp_path / "ck"), "--run-dir", str(tmp_path / "run"), *extra])
    assert rc == 0
    assert time.monotonic() - t0 > 12  # the save really took that long
    ckpt = latest_dir(str(tmp_path / "ck"))
    assert ckpt is not None and read_meta(ckpt)["step"] == 2
    assert verify_checkpoint(ckpt) == []  # every file's sha256 and size as committed
    assert _children() == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_save_stuck_past_its_bound_is_reported_naming_the_saving_rank(tmp_path, monkeypatch,
                                                                      capfd):
    monkeypatch.setenv("MINI3D_TEST_PAUSE_IN_SAVE", "120")  # the writer never finishes in time
    monkeypatch.setenv(sc.BOUND_ENV, "2")  # a short bound, so that the test is short
    t0 = time.monotonic()
    rc = main([*JOB, "--save", str(tmp_path / "ck"), "--run-dir", str(tmp_path / "run")])
    err = capfd.readouterr().err
    assert rc == 3
    assert time.monotonic() - t0 < 90  # ended by the save's bound, not by the 120 s pause
    # every rank writes its share (sharded saves) and pauses after it: whichever rank's watchdog
    # fires first is named, as the rank stuck in its own save (not as a rank waiting for another)
    first = re.match(r"mini3d train: rank ([01]) \(tp=0, pp=0, dp=([01])\) was stuck in its "
                     r"checkpoint save", err.splitlines()[0])
    assert first and first.group(1) == first.group(2), err
    assert latest_dir(str(tmp_path / "ck")) is None  # no checkpoint was committed
    ex = explain(str(tmp_path / "run"))
    assert (ex.culprit, ex.kind) == (int(first.group(1)), "save"), ex.text
    assert f"rank {ex.culprit}'s checkpoint save of step 2 has run" in ex.text, ex.text
    assert _children() == []
    assert not os.path.exists(tmp_path / "ck" / "step-000002")
