"""Reliability campaign (issue #33), run by hand, not in the suite:

    OMP_NUM_THREADS=1 python benchmarks/reliability_campaign.py [faults] [signals] [inputs]
        [--repeats 3] [--layouts tp2,pp2,pp2i,cp2,dp2z2,dp2ep2] [--out results.jsonl]

Three kinds of trial, each a real `mini3d train` subprocess, each counted on five checks:

- faults: every injected fault kind on rank 1 at step 1 x six 2-rank layouts x repeats (p2p-order
  on the pipelines only, a2a-split on the ep layout only). Expected:
  the kind's exit code; the first stderr line names rank 1 (the culprit, not a victim); no Python
  traceback on the terminal (a `raise` fault's own traceback, shown under its marker, excepted); no
  process of the trial left; no `mini3d-rdzv-*` directory left.
- signals: SIGTERM / SIGINT to the launcher at a few delays during the ranks' start-up x repeats.
  Expected: 143 / 130; no rank blamed; no traceback; no process and no directory left.
- inputs: the bad-input table of tests/test_bad_input.py's kinds plus generated ones (every numeric
  flag at 0, -1, nan and huge; every path flag at a missing directory, a file and a read-only
  directory), each with --dry-run so that an accepted value starts nothing, each in this one
  process (`mini3d.cli.main`: a bad input must be refused before any process starts). Expected: exit 2 where
  the value is invalid (-1, nan, the bad paths), 0 or 2 otherwise; no traceback; no directory left.

Every trial runs with its own TMPDIR and a marker in its environment (found in /proc afterwards).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.test_orphans import marked  # noqa: E402  (live processes carrying a job's marker)
SMALL = ["--hidden", "32", "--global-batch", "4", "--seq-len", "16", "--no-progress"]
LAYOUTS = {
    "tp2": ["--tp", "2"],
    "pp2": ["--pp", "2", "--micro-batches", "2"],
    "pp2i": ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "2"],
    "cp2": ["--cp", "2"],
    "dp2z2": ["--dp", "2", "--zero", "2"],
    "dp2ep2": ["--dp", "2", "--ep", "2", "--experts", "4", "--top-k", "2", "--family", "llama",
               "--kv-heads", "2"],
}
FAULTS = {"crash": (1, 3), "skip": (1, 3), "shape": (1, 3), "freeze": (3,), "raise": (1,),
          "p2p-order": (3,), "a2a-split": (1, 3)}
ONLY = {"p2p-order": ("pp",), "a2a-split": ("dp2ep2",)}  # faults that need a pipeline / an ep group
HANG = 3.0


def _default_stop_signals():
    """In the trial's child: SIGINT / SIGTERM at their default action. A campaign started in the
    background (`nohup ... &`) ignores SIGINT, and an ignored SIGINT is inherited: one sent before
    `python -m mini3d` installs its handler would be dropped, a harness artifact (seen once: a
    SIGINT at 1 s, under load, and the job trained to the end with exit 0)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def trial(args: list[str], kill_after: float | None = None, sig=None, timeout: float = 240):
    """Run `mini3d ARGS`; returns (rc, stderr, seconds, processes left, dirs left in its TMPDIR)."""
    value = uuid.uuid4().hex
    tmp = tempfile.mkdtemp(prefix="campaign-")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", TMPDIR=tmp, MINI3D_CAMPAIGN=value)
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "mini3d", *args], env=env, cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_default_stop_signals)
    if kill_after is not None:
        time.sleep(kill_after)
        p.send_signal(sig)
    try:
        err = p.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        p.kill()
        err = p.communicate()[1] + "\n[campaign: timed out]"
    seconds = time.monotonic() - t0
    marker = f"MINI3D_CAMPAIGN={value}".encode()
    deadline = time.monotonic() + 10
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = marked(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    dirs = sorted(n for n in os.listdir(tmp) if n.startswith(("mini3d-", "torchelastic")))
    subprocess.run(["chmod", "-R", "u+w", tmp])
    subprocess.run(["rm", "-rf", tmp])
    return p.returncode, err, seconds, left, dirs


def no_traceback(err: str) -> bool:
    head = err.split("--- rank ")[0]  # a `raise` fault's own traceback is shown under its marker
    return "Traceback" not in head and "EOFError" not in err and "resource_tracker" not in err


def fault_trials(layouts, repeats):
    for r in range(repeats):
        for name in layouts:
            for kind, codes in FAULTS.items():
                if kind in ONLY and not name.startswith(ONLY[kind]):
                    continue
                run = tempfile.mkdtemp(prefix="campaign-run-")
                args = ["train", *SMALL, *LAYOUTS[name], "--steps", "3", "--hang-timeout", str(HANG),
                        "--timeout", "150", "--run-dir", run, "--inject-fault", f"{kind}:1:1"]
                rc, err, s, left, dirs = trial(args)
                first = (err.strip().splitlines() or [""])[0]
                yield dict(group="faults", case=f"{name} {kind}", repeat=r, rc=rc, seconds=round(s, 1),
                           ok_rc=rc in codes, ok_culprit=first.startswith("mini3d train: rank 1 ("),
                           ok_traceback=no_traceback(err), ok_procs=not left,
                           ok_dirs=not [d for d in dirs if d.startswith("mini3d-rdzv-")],
                           first=first[:200])
                subprocess.run(["rm", "-rf", run])


def signal_trials(repeats, delays=(1.0, 4.0, 8.0)):  # import, spawn, rank start-up (loaded host)
    for r in range(repeats):
        for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
            for delay in delays:
                args = ["train", *SMALL, "--dp", "2", "--steps", "200"]
                rc, err, s, left, dirs = trial(args, delay, sig)
                first = (err.strip().splitlines() or [""])[0]
                yield dict(group="signals", case=f"{sig.name} at {delay}s", repeat=r, rc=rc,
                           seconds=round(s, 1), ok_rc=rc == code,
                           ok_culprit="failed" not in first and "crashed" not in first,
                           ok_traceback=no_traceback(err), ok_procs=not left, ok_dirs=not dirs,
                           first=first[:200])


def input_cases(tmp: str) -> list[tuple[str, list[str], bool]]:
    """(name, args, must be refused): the generated bad inputs."""
    ints = ["--layers", "--hidden", "--heads", "--vocab", "--ffn", "--kv-heads", "--tp", "--pp",
            "--dp", "--cp", "--virtual-stages", "--micro-batches", "--global-batch", "--seq-len",
            "--steps", "--save-every", "--eval-every", "--eval-batches", "--warmup-steps",
            "--decay-steps", "--sample-every", "--keep-last", "--log-every", "--world-size",
            "--max-seq-len", "--gpus-per-node"]
    floats = ["--lr", "--grad-clip", "--hang-timeout", "--timeout", "--min-lr", "--weight-decay",
              "--bucket-mb", "--rope-base"]
    out = []
    for flag in ints + floats:
        for value, refuse in (("0", False), ("-1", True), ("nan", True), ("1e30", False)):
            if flag in ints and value == "1e30":
                value = str(10**12)
            out.append((f"{flag} {value}", [flag, value], refuse))
    missing, afile, ro = os.path.join(tmp, "missing", "x"), os.path.join(tmp, "afile"), os.path.join(tmp, "ro")
    open(afile, "w").close()
    os.makedirs(ro, exist_ok=True)
    os.chmod(ro, 0o500)
    for flag in ("--data", "--resume", "--init-from-hf", "--tokenizer"):
        out.append((f"{flag} missing", [flag, missing], True))
        out.append((f"{flag} file", [flag, afile], True))
    for flag in ("--save", "--log-jsonl", "--tensorboard", "--run-dir"):
        out.append((f"{flag} file", [flag, os.path.join(afile, "sub")], True))
        out.append((f"{flag} read-only", [flag, os.path.join(ro, "sub")], True))
    out += [(f"--inject-fault {f}", ["--inject-fault", f], True) for f in
            ("crash:9:1", "skip:0:99", "bogus:0:1", "slow:0:1:nan", "p2p-order:0:1", "skip:-1:1")]
    return out


def in_process(args: list[str]):
    """`mini3d ARGS` in this process (a bad input must be refused before any process starts, so
    importing torch once serves every case): (rc, stderr, seconds, children left, dirs left)."""
    import contextlib
    import io
    import multiprocessing
    import traceback

    from mini3d.cli import main as mini3d_main

    tmp = tempfile.mkdtemp(prefix="campaign-")
    saved, tempfile.tempdir = tempfile.tempdir, tmp
    err, out = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = mini3d_main(args)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException:
        rc = "raised"
        err.write(traceback.format_exc())
    finally:
        tempfile.tempdir = saved
    left = [p.pid for p in multiprocessing.active_children()]
    dirs = sorted(n for n in os.listdir(tmp) if n.startswith(("mini3d-", "torchelastic")))
    subprocess.run(["rm", "-rf", tmp])
    return rc, err.getvalue(), time.monotonic() - t0, left, dirs


def input_trials():
    tmp = tempfile.mkdtemp(prefix="campaign-inputs-")
    for name, extra, refuse in input_cases(tmp):
        args = ["train", *SMALL, "--steps", "2", *extra, "--dry-run"]
        rc, err, s, left, dirs = in_process(args)
        yield dict(group="inputs", case=name, repeat=0, rc=rc, seconds=round(s, 1),
                   ok_rc=rc == 2 if refuse else rc in (0, 2),
                   ok_culprit=rc != 2 or "bad input" in err or "error:" in err,
                   ok_traceback=no_traceback(err), ok_procs=not left, ok_dirs=not dirs,
                   first=(err.strip().splitlines() or [""])[0][:200])
    os.chmod(os.path.join(tmp, "ro"), 0o700)
    subprocess.run(["rm", "-rf", tmp])


CHECKS = ("ok_rc", "ok_culprit", "ok_traceback", "ok_procs", "ok_dirs")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("groups", nargs="*", default=["faults", "signals", "inputs"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--out", default="reliability_campaign.jsonl")
    a = p.parse_args(argv)
    gens = {"faults": lambda: fault_trials(a.layouts.split(","), a.repeats),
            "signals": lambda: signal_trials(a.repeats), "inputs": input_trials}
    tally = collections.defaultdict(collections.Counter)
    with open(a.out, "a") as f:
        for g in a.groups:
            for row in gens[g]():
                f.write(json.dumps(row) + "\n")
                f.flush()
                bad = [c for c in CHECKS if not row[c]]
                tally[g]["trials"] += 1
                for c in CHECKS:
                    tally[g][c] += row[c]
                print(f"{g:8} {row['case']:28} rc={row['rc']:<4} {row['seconds']:6.1f}s "
                      f"{'ok' if not bad else 'FAIL ' + ','.join(bad)}  {row['first'][:90]}",
                      flush=True)
    for g, t in tally.items():
        print(f"{g}: {t['trials']} trials; " + ", ".join(f"{c[3:]} {t[c]}/{t['trials']}" for c in CHECKS))


if __name__ == "__main__":
    main()
