"""A failed run's directory, read back: every rank's dump, the launcher's exit record, stacks.

`load_run(run_dir)` gives a `Run`; the per-rank facts below (`who`, `doing`, `death`, `entered`)
are what `explain.py` reasons over. The files: `rank{r}.json` (each rank's watchdog, see
watchdog.py), `launcher.json` (every rank's exit status, from `launch(run_dir=...)`) and
`rank{r}.stack` (the Python stack of a rank the communication library aborted).

`mini3d train` gives each job its own `RUN_DIR/job-<id>` (ids sort by start time), so jobs that
share a `--run-dir` keep each other's post-mortems; `pick_job` chooses the one to explain.

Without `--run-dir` a job runs in a temporary `TMPDIR/mini3d-run-*` (`make_default`), removed when
the job ends well, kept (and named in the failure report) when it fails. A launcher killed outright
(SIGKILL, the OOM killer) can do neither: its directory records its owner as the rendezvous
directory does (mini3d.launch.rdzv), and the next start removes those whose owner is gone and that
hold no post-mortem; one that holds a post-mortem is kept and named once (`sweep_default`).
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
from dataclasses import dataclass, field

from mini3d.launch.jobs import JOB_PREFIX

from mini3d.grid import Grid
from mini3d.diagnose.history import describe_op, process_state


@dataclass
class Run:
    """Everything a run directory holds."""

    dumps: dict  # rank -> dump dict
    launcher: dict | None
    stacks: dict  # rank -> faulthandler text
    grid: Grid | None = None
    stderr: dict = field(default_factory=dict)  # rank -> what C++ libraries wrote (rank{r}.stderr)
    world: int = 0
    issued: dict = field(default_factory=dict)  # rank -> its black box's ops (diagnose/blackbox.py)
    ended: dict = field(default_factory=dict)  # rank -> the steps its black box saw end

    @property
    def exits(self) -> dict:
        return {r["rank"]: r for r in (self.launcher or {}).get("ranks", [])}


def _dumps_in(path: str) -> list[str]:
    return [p for p in glob.glob(os.path.join(path, "rank*.json"))
            if re.fullmatch(r"rank\d+\.json", os.path.basename(p))]


def job_outcome(path: str) -> str:
    """'failed' (a launcher record, or a rank that did not finish), 'finished', or 'no dumps'."""
    statuses = set()
    for p in _dumps_in(path):
        try:
            with open(p) as f:
                statuses.add(json.load(f).get("status"))
        except (OSError, ValueError, AttributeError):
            statuses.add("damaged")
    if os.path.exists(os.path.join(path, "launcher.json")) or statuses - {"finished"}:
        return "failed"
    return "finished" if statuses else "no dumps"


def jobs(run_dir: str) -> list[tuple[str, str]]:
    """(job directory, outcome) of every job in a shared run directory, oldest first."""
    names = sorted(n for n in os.listdir(run_dir) if n.startswith(JOB_PREFIX)
                   and os.path.isdir(os.path.join(run_dir, n)))
    return [(os.path.join(run_dir, n), job_outcome(os.path.join(run_dir, n))) for n in names]


def pick_job(run_dir: str) -> tuple[str, list[tuple[str, str]]]:
    """(the directory to explain, the jobs found): `run_dir` itself when it holds dumps (a job's
    own directory), else its latest failed job, else its latest job."""
    if _dumps_in(run_dir) or not os.path.isdir(run_dir):
        return run_dir, []
    found = jobs(run_dir)
    failed = [p for p, outcome in found if outcome == "failed"]
    chosen = failed[-1] if failed else (found[-1][0] if found else run_dir)
    return chosen, found


DEFAULT_PREFIX = "mini3d-run-"  # TMPDIR/mini3d-run-*: the run directory of a job without --run-dir
KEPT = "owner.kept"  # the owner record, renamed once a dead owner's post-mortem was named


def holds_post_mortem(path: str) -> bool:
    """Does run directory `path` hold a failed job's dumps or launcher record (its own or a job's)?
    (True when it cannot be read: only what is known to hold nothing is removed.)"""
    try:
        return job_outcome(path) == "failed" or any(
            outcome == "failed" for _, outcome in jobs(path))
    except OSError:
        return True


def _keep_once(path: str) -> bool:
    """`sweep`'s keep: a dead owner's directory with a post-mortem stays, and is named this once."""
    if not holds_post_mortem(path):
        return False
    from mini3d.launch.rdzv import OWNER

    try:
        os.replace(os.path.join(path, OWNER), os.path.join(path, KEPT))  # never named again
    except OSError:
        pass
    import sys

    print(f"mini3d: kept {path}: the launcher that made it was killed (SIGKILL?) and it holds a "
          f"failed job's post-mortem (mini3d explain-hang {path}); remove it when you are done",
          file=sys.stderr, flush=True)
    return True


def sweep_default(tmp: str | None = None) -> list[str]:
    """Remove the default run directories under `tmp` (the temp dir) whose launcher is gone and
    that hold no post-mortem; name the others once. Returns the removed ones."""
    from mini3d.launch.rdzv import sweep

    return sweep(tmp, DEFAULT_PREFIX, keep=_keep_once)


def make_default() -> str:
    """A new default run directory owned by this process (after sweeping stale ones)."""
    import tempfile

    from mini3d.launch.rdzv import claim

    sweep_default()
    path = tempfile.mkdtemp(prefix=DEFAULT_PREFIX)
    claim(path)
    return path


def release(path: str):
    """This launcher reported on its default run directory (a failure): it is the user's now,
    never swept (the owner record goes; `sweep` leaves a directory without one alone)."""
    from mini3d.launch.rdzv import OWNER

    try:
        os.remove(os.path.join(path, OWNER))
    except OSError:
        pass


def load_run(run_dir: str) -> Run:
    run_dir = pick_job(run_dir)[0]
    dumps = {}
    for path in _dumps_in(run_dir):  # (rank{r}.exit.json, torchrun's, are read via launcher.json)
        with open(path) as f:
            d = json.load(f)
        dumps[int(d["rank"])] = d
    launcher = None
    if os.path.exists(os.path.join(run_dir, "launcher.json")):
        with open(os.path.join(run_dir, "launcher.json")) as f:
            launcher = json.load(f)
    stacks = {}
    for path in glob.glob(os.path.join(run_dir, "rank*.stack")):
        with open(path) as f:
            text = f.read()
        if text.strip():
            stacks[int(re.findall(r"rank(\d+)\.stack$", path)[0])] = text
    from mini3d.diagnose.blackbox import ended, read

    run = Run(dumps, launcher, stacks, issued=read(run_dir), ended=ended(run_dir))
    for path in glob.glob(os.path.join(run_dir, "rank*.stderr")):
        with open(path, errors="replace") as f:
            run.stderr[int(re.findall(r"rank(\d+)\.stderr$", path)[0])] = f.read(20000)
    if dumps:
        g = next(iter(dumps.values()))["grid"]
        run.grid = Grid(g["tp"], g["pp"], g["dp"], g.get("order", "tp-dp-pp"), cp=g.get("cp", 1),
                        ep=g.get("ep", 1))
        run.world = run.grid.world_size
    return run


def who(run: Run, r: int) -> str:
    """'rank 3 (tp=1, pp=1, dp=0)', with cp= (and ep=) when that axis is split."""
    c = run.grid.coords(r)
    return f"rank {r} ({coords_text(c, {**run.grid.sizes, 'ep': run.grid.ep})})"


def coords_text(c: dict, sizes: dict) -> str:
    """'tp=1, pp=1, dp=0': tp, pp and dp always, cp and ep where the grid splits them."""
    names = [a for a in ("tp", "cp", "ep", "pp", "dp") if a in c and (
        a in ("tp", "pp", "dp") or sizes.get(a, 1) > 1)]
    return ", ".join(f"{a}={c[a]}" for a in names)


def seq_key(ev: dict) -> str:
    if ev["op"] == "send":
        return f"{ev['axis']}/p2p->{ev['peer']}"
    if ev["op"] == "recv":
        return f"{ev['axis']}/p2p<-{ev['peer']}"
    return f"{ev['axis']}/{ev['op']}"


def death(run: Run, r: int) -> str:
    """How a rank without a dump ended, from launcher.json and its stack file."""
    info = run.exits.get(r, {})
    code = info.get("exitcode")
    state = process_state(run, r)
    if code is None and state == "stopped":
        s = "stopped responding: its process was frozen (stopped, e.g. by SIGSTOP) and left no dump"
    elif code is None and state == "running":
        s = "stopped responding: its process was alive but neither communicated nor dumped"
    elif code is None and "terminate called" in run.stderr.get(r, ""):
        s = "was aborted by the communication library (SIGABRT) and left no dump"
    elif code is None:
        s = "left no dump (its exit status is unknown)"
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        s = f"was killed by {name} and left no dump"
    else:
        s = f"exited with status {code} without a dump"
    stack = run.stacks.get(r, "")
    ops = re.findall(r'comm\.py", line \d+ in (\w+)', stack)
    public = [o for o in ops if not o.startswith("_")]
    if public:
        s += f"; its stack shows it inside {public[0]}"
        if code == -signal.SIGABRT:
            s += " (the communication library aborted it: gloo does so on a size mismatch)"
    return s


def doing(run: Run, r: int) -> str:
    d = run.dumps.get(r)
    if d is None:
        return death(run, r)
    if d["status"] == "finished":
        return "has finished"
    if d["status"] == "oom":
        return f"stopped on OutOfMemory ({', '.join(f'{k} {v}' for k, v in d['context'].items())})"
    if d.get("blocked"):
        verb = "failed in" if d["status"] == "error" else "waits in"
        return f"{verb} {describe_op(d['blocked'])}"
    return f"is running outside communication ({d['status']}, context {d.get('context')})"


def _event(d: dict, key: str, seq: int) -> dict | None:
    return next((e for e in d["events"] if seq_key(e) == key and e["seq"] == seq), None)


def entered(run: Run, m: int, key: str, seq: int) -> bool:
    """Has rank m issued op #seq of `key`? An op begun but queued behind another blocking op
    (pending, not the one m is blocked in) has not reached the wire."""
    d = run.dumps[m]
    if d["seq"].get(key, 0) < seq:
        return False
    ev = _event(d, key, seq)
    return not (ev is not None and ev["pending"] and not ev["blocked"])
