"""The failure report of `mini3d train`: the rank that caused it first, its victims after.

    rank 1 (tp=1, pp=0, dp=0) was killed by signal 9 (SIGKILL) in step 1
    the other ranks stopped because of it: ranks 0, 3 lost their connection to a peer; rank 2 ...
    why: ...
    (every rank's state, tracebacks and library messages: RUN_DIR; mini3d explain-hang RUN_DIR)

The culprit comes from `explain` (the wait-for graph of the dumps, with launcher.json's exit
statuses); the first rank to *report* an error is usually a victim (gloo's "Connection closed by
peer" on the rank that waited for a dead one), so the launcher's first exception is only the
fallback. Library noise (gloo's `terminate called ...`, C++ warnings) goes to `RUN_DIR/rank{r}.stderr`
(`mini3d.diagnose.watchdog.keep_library_noise_in`), and tracebacks to launcher.json, not to the first lines of the terminal.
"""

from __future__ import annotations

import os
import signal

from mini3d.diagnose.explain import death, explain, load_run, who
from mini3d.diagnose.history import VICTIM_ERRORS
from mini3d.diagnose.run_dir import pick_job

CAUSES = {
    "skip": "skipped a collective its group's other members entered",
    "shape": "entered a collective with the wrong tensor shape",
    "shape-p2p": "sent a point-to-point message with the wrong tensor shape",
    "p2p-order": "is in a point-to-point order deadlock with its pipeline neighbour",
    "a2a-split": "sent an all-to-all block of another size than its peer expected (split sizes)",
    "straggler": "stopped responding (it never reached the op its peers waited in)",
    "stopped": "stopped responding (its process was frozen, e.g. by SIGSTOP)",
    "oom": "ran out of memory",
    "save": "was stuck in its checkpoint save, past the save's bound",
}


def _killed(code: int) -> str:
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "?"
    return f"was killed by signal {-code} ({name})"


def _cause(run, r: int, kind: str) -> str:
    d = run.dumps.get(r)
    if kind == "error" and d:
        return f"crashed with {d['reason'][:300]}"
    if kind in CAUSES:
        return CAUSES[kind]
    code = run.exits.get(r, {}).get("exitcode")
    if code is not None and code < 0:
        return _killed(code)
    if code:
        return f"exited with status {code} without a Python exception"
    return death(run, r).replace(" and left no dump", "")


def _step(run, r: int):
    """The step the culprit was in: its own dump's, else that of the ops its peers waited in."""
    d = run.dumps.get(r)
    if d and "step" in (d.get("context") or {}):
        return d["context"]["step"]
    steps = [(x.get("blocked") or {}).get("context", {}).get("step") for x in run.dumps.values()]
    steps = [s for s in steps if s is not None] or [
        (x.get("context") or {}).get("step") for x in run.dumps.values()]
    steps = [s for s in steps if s is not None]
    return min(steps) if steps else None


def _victim(run, r: int) -> str:
    d = run.dumps.get(r)
    if d is None:
        code = run.exits.get(r, {}).get("exitcode")
        if code == -signal.SIGABRT or "terminate called" in run.stderr.get(r, ""):
            return "were aborted by the communication library (a size mismatch)"
        return "left no dump"
    status = d["status"]
    if status == "aborted":
        return "were stopped by the job's abort"
    if status == "hang":
        return "saw the hang (their watchdog fired)"
    if status == "error" and VICTIM_ERRORS.search(d.get("reason") or ""):
        return "lost their connection to a peer"
    if status == "finished":
        return "had finished"
    return f"stopped ({status})"


def victims_line(run, culprit: int) -> str:
    by: dict[str, list[int]] = {}
    for r in range(run.world):
        if r != culprit:
            by.setdefault(_victim(run, r), []).append(r)
    parts = [f"{'ranks' if len(rs) > 1 else 'rank'} {', '.join(map(str, rs))} "
             f"{what if len(rs) > 1 else what.replace('were ', 'was ').replace('their', 'its')}"
             for what, rs in by.items()]
    return "the other ranks stopped because of it: " + "; ".join(parts) if parts else ""


def _disk_full(run_dir: str) -> list[str] | None:
    """A full disk under a checkpoint, or a non-finite loss, is the story whichever rank hit it."""
    import json

    try:
        with open(os.path.join(run_dir, "launcher.json")) as f:
            ranks = json.load(f)["ranks"]
    except (OSError, ValueError, KeyError):
        return None
    for r in ranks:
        for kind in ("DiskFull: ", "NonFiniteLoss: "):  # each says where and what
            if (r.get("error") or "").startswith(kind):
                return [r["error"][len(kind):].splitlines()[0] + f" (rank {r['rank']})",
                        f"(every rank's state: {run_dir})"]
    return None


def failure_report(run_dir: str | None) -> list[str] | None:
    """The report's lines, culprit first; None when the run directory cannot name a culprit."""
    if not run_dir or not os.path.isdir(run_dir):
        return None
    run_dir = pick_job(run_dir)[0]
    full = _disk_full(run_dir)
    if full:
        return full
    ex = explain(run_dir)
    if ex is None or ex.culprit is None:
        return None
    run = load_run(run_dir)
    c = ex.culprit
    step = _step(run, c)
    cause = _cause(run, c, ex.kind)  # (an error's own text may already say its step)
    said = step is None or f"in step {step}" in cause
    lines = [f"{who(run, c)} {cause}" + ("" if said else f" in step {step}")]
    victims = victims_line(run, c)
    if victims:
        lines.append(victims)
    if ex.findings and ex.kind not in ("error", "oom"):
        lines.append("why: " + ex.findings[-1].splitlines()[0])
    tb = (run.exits.get(c, {}).get("traceback") or "").strip().splitlines()
    if ex.kind == "error" and tb:
        lines.append(f"--- rank {c}'s traceback (last lines; all of it in {run_dir}/launcher.json) ---")
        lines += tb[-6:]
    lines.append(f"(every rank's state, tracebacks and library messages: {run_dir}; "
                 f"run: mini3d explain-hang {run_dir})")
    return lines


__all__ = ["failure_report", "victims_line"]
