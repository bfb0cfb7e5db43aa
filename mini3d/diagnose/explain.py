"""`explain-hang`: merge every rank's dump and say, in terms of the plan, what went wrong.

Inputs: the run directory as `run_dir.load_run` reads it (every rank's watchdog dump, the
launcher's exit record, the stacks of aborted ranks).

Method. `Event.seq` counts ops per (axis, op kind) on each rank (per peer for send/recv), so the
k-th all_reduce on a dp group is the same op on every member. For the op each rank is blocked in,
we ask every other member (or the p2p peer) whether it has entered the matching op; each "no" is an
edge of a wait-for graph, labelled with what that member does instead. Following the edges ends at
the culprit: a rank that crashed (no dump), finished without the op (it skipped one), runs outside
communication (a straggler), or at a cycle (a point-to-point order deadlock). Independently, the
same op's shape is compared across members (shape mismatch), an all-to-all's split sizes between
sender and receiver (a2a-split), and each group's ops are aligned by seq to find the first one
whose step or shape differs between members (where a skip happened).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mini3d.diagnose.history import (describe_op, diverged_behind_abort, diverging_rank, own_error,
                                     process_state)
from mini3d.diagnose.divergence import first_divergence, shape_mismatch, split_mismatch
from mini3d.diagnose.run_dir import Run, death, doing, entered, load_run, pick_job, seq_key, who



@dataclass
class Explanation:
    text: str
    culprit: int | None = None  # world rank judged responsible
    kind: str = "unknown"  # crash, error, stopped, skip, shape(-p2p), p2p-order, a2a-split,
    # straggler, oom, save, finished, unknown
    findings: list = field(default_factory=list)


def waits_for(run: Run, r: int) -> list[tuple[int, str]]:
    """(member, why) for each rank that r's blocked op waits for."""
    d = run.dumps.get(r)
    ev = d.get("blocked") if d else None
    if ev is None:
        return []
    if ev["op"] in ("send", "recv"):
        q = ev["peer"]
        back = f"{ev['axis']}/p2p<-{r}" if ev["op"] == "send" else f"{ev['axis']}/p2p->{r}"
        others = [(q, back)]
    else:
        others = [(m, seq_key(ev)) for m in ev["group"] if m != r]
    out = []
    for m, key in others:
        if m not in run.dumps:
            out.append((m, f"rank {m} {death(run, m)}"))
        elif not entered(run, m, key, ev["seq"]):
            n = run.dumps[m]["seq"].get(key, 0)
            if ev["op"] in ("send", "recv"):
                other = "recv" if ev["op"] == "send" else "send"
                out.append((m, f"rank {m} has not issued the matching {other} #{ev['seq']} and "
                               f"{doing(run, m)}"))
            else:
                out.append((m, f"rank {m} never entered it (it issued {n} {ev['op']} on that "
                               f"group) and {doing(run, m)}"))
    return out


# ----------------------------------------------------------------------------- findings

def follow(run: Run, start: int) -> tuple[list[int], str]:
    """Walk the wait-for graph from `start`; returns (path, how it ends)."""
    path = [start]
    while True:
        edges = waits_for(run, path[-1])
        if not edges:
            return path, "end"
        nxt = edges[0][0]
        if nxt in path:
            return path[path.index(nxt):], "cycle"
        path.append(nxt)
        if nxt not in run.dumps or not run.dumps[nxt].get("blocked"):
            return path, "end"


def _all_p2p(run: Run, cycle: list[int]) -> bool:
    return all(run.dumps[r]["blocked"]["op"] in ("send", "recv") for r in cycle)


def _p2p_cycle_text(run: Run, cycle: list[int]) -> tuple[int, str]:
    ops = {r: run.dumps[r]["blocked"]["op"] for r in cycle}
    kind = "recv" if all(o == "recv" for o in ops.values()) else (
        "send" if all(o == "send" for o in ops.values()) else "mixed")
    culprit = cycle[0]
    for r in cycle:  # the rank holding a send it never got to (queued behind its recv) reordered
        if any(e["op"] == "send" and e["pending"] and not e["blocked"] for e in run.dumps[r]["pending"]):
            culprit = r
    names = " and ".join(f"rank {r}" for r in cycle)
    every = "both" if len(cycle) == 2 else "all"
    text = (f"point-to-point order deadlock: {names} {every} wait in {kind} from each other"
            if kind != "mixed" else f"deadlock cycle between {names}")
    if kind == "recv":
        text += f"; rank {culprit} posted its recv before its send"
    return culprit, text


HINTS = {
    "crash": "find why rank {c} died (its stderr, `dmesg` for the OOM killer); all ranks must run "
             "to the end of every step",
    "skip": "every member of a group must issue the same collectives in the same order: look for a "
            "condition on rank {c} (e.g. `if rank == ...`, an early `continue`) around that step",
    "shape": "tensors in one collective must have the same shape on every member; rank {c}'s "
             "differs (a per-rank batch or padding size?)",
    "shape-p2p": "a send and its recv must have the same shape: rank {c}'s send differs from what "
                 "its pipeline neighbour expects (a micro-batch or sequence length that varies?)",
    "a2a-split": "an all-to-all's sizes must agree: what rank {c} sends member j (its input "
                 "split j) is what j expects from it (j's output split), the counts exchanged "
                 "before the rows; derive both from one count table (mini3d.ep.dispatch)",
    "p2p-order": "pair every send with a recv posted in a compatible order: the lower pipeline "
                 "index sends first, the higher receives first (see mini3d.pp.p2p.PipeP2P.exchange)",
    "straggler": "rank {c} is slow or stuck outside communication: compare its step time, or "
                 "raise --hang-timeout if the work is just long",
    "stopped": "rank {c}'s process stopped running (SIGSTOP, a debugger, a frozen node): "
               "look at that host; a stopped process never answers its peers",
    "error": "rank {c} raised an exception of its own: its traceback is in the run directory "
             "(launcher.json); the other ranks only lost their connection to it",
    "oom": "see the OOM report above: lower the named category or give the rank more memory",
    "save": "look at the disk rank {c} writes its checkpoint to (full, slow, a hung network mount); "
            "a disk known to be slower than the save's bound allows: set MINI3D_SAVE_BOUND_S",
}


def _rank_line(run: Run, r: int) -> str:
    d = run.dumps.get(r)
    if d is None:
        return f"  {who(run, r)}: {death(run, r)}"
    status = d["status"]
    shown = ("error", "oom", "hang", "stuck-save")
    reason = f" ({d['reason'][:90]})" if status in shown and d.get("reason") else ""
    return f"  {who(run, r)}: {status}{reason}; {doing(run, r)}"


def _self_reported(run: Run) -> tuple[int, str, list[str]] | None:
    """A rank whose own dump says what went wrong: out of memory, or stuck in its checkpoint save
    past the save's bound (diagnose/save_clock.py)."""
    for r, d in sorted(run.dumps.items()):
        if d["status"] == "oom":
            oom = d.get("oom") or {}
            return r, "oom", [f"{who(run, r)} ran out of memory in category "
                              f"{oom.get('category', '?')}:\n" + oom.get("report", d["reason"])]
    saves = [r for r, d in sorted(run.dumps.items()) if d["status"] == "stuck-save"]
    return (saves[0], "save", [run.dumps[saves[0]]["reason"]]) if saves else None


def _dead_end(run: Run, end: int, findings: list[str]) -> tuple[int, str, list[str]]:
    """The wait-for graph ends at a rank without a dump: it departed from its own previous step
    (its black box), it is frozen, a live rank departed (the dead one a victim), or it crashed."""
    own = diverging_rank(run, [end]) if end in run.issued else None
    if own:  # it skipped an op or changed a shape before it went silent
        return own[0], own[1], findings + [own[2]]
    if process_state(run, end) in ("stopped", "running"):
        return end, "stopped", findings
    diverged = diverged_behind_abort(run, end)
    if diverged:
        return diverged[0], diverged[1], findings + [diverged[2]]
    return end, "crash", findings


def _culprit(run: Run) -> tuple[int | None, str, list[str]]:
    """(culprit rank, kind, finding lines), strongest evidence first."""
    findings = []
    own = _self_reported(run)
    if own is not None:
        return own
    mine = own_error(run)
    if mine is not None:
        findings.append(f"{who(run, mine)} raised {run.dumps[mine]['reason']}")
        return mine, "error", findings
    waits = []
    for r in sorted(run.dumps):
        for m, why in waits_for(run, r):
            waits.append(f"{who(run, r)} waits in {describe_op(run.dumps[r]['blocked'])}; {why}")
    split = split_mismatch(run)
    if split:
        return split[0], "a2a-split", findings + waits + [split[1]]
    shape = shape_mismatch(run)
    skip = first_divergence(run)
    ends = [follow(run, r) for r in sorted(run.dumps) if waits_for(run, r)]
    if shape:
        findings += [shape[1]] + waits
        return shape[0], "shape", findings
    findings += waits
    if skip:
        findings.append(skip[1])
        if any(how == "cycle" or path[-1] in run.dumps for path, how in ends):
            # the missing collective is what the others wait for, directly or around a cycle
            return skip[0], "skip", findings
    for path, how in ends:
        if how == "cycle":
            own = None if _all_p2p(run, path) else diverging_rank(run, path)
            if own:  # collectives in a cycle: a member that departed from its own previous step
                return own[0], own[1], findings + [own[2]]
            c, text = _p2p_cycle_text(run, path)
            return c, "p2p-order", findings + [text]
    for path, how in ends:
        end = path[-1]
        if end not in run.dumps:
            return _dead_end(run, end, findings)
        if run.dumps[end]["status"] == "finished":
            return (skip[0] if skip else end), "skip", findings
        own = diverging_rank(run, [end])  # not a straggler if its own steps differ
        if own:
            return own[0], own[1], findings + [own[2]]
        return end, "straggler", findings
    dead = [r for r in range(run.world) if r not in run.dumps]
    frozen = [r for r in dead if process_state(run, r) in ("stopped", "running")]
    if frozen:
        return frozen[0], "stopped", findings + [f"rank {r} {death(run, r)}" for r in frozen]
    if dead and diverged_behind_abort(run, dead[0]):
        r, kind, text = diverged_behind_abort(run, dead[0])
        return r, kind, findings + [text]
    if dead:
        return dead[0], "crash", findings + [f"rank {r} {death(run, r)}" for r in dead]
    if skip:
        return skip[0], "skip", findings
    if all(d["status"] == "finished" for d in run.dumps.values()):
        return None, "finished", findings
    return None, "unknown", findings


HEADLINES = {
    "oom": "{w} ran out of memory",
    "crash": "{w} crashed; the ranks that needed it could not go on",
    "skip": "{w} skipped a collective its group's other members entered",
    "shape": "{w} entered a collective with the wrong tensor shape",
    "shape-p2p": "{w} sent a point-to-point message with the wrong tensor shape",
    "p2p-order": "{w} is in a point-to-point order deadlock",
    "a2a-split": "{w} sent an all-to-all block of another size than its peer expected",
    "straggler": "{w} did not reach the op its peers wait in (slow or stuck outside communication)",
    "stopped": "{w} stopped responding (its process was frozen); its peers waited for it",
    "error": "{w} crashed with an exception of its own; the other ranks lost their connection to it",
    "save": "{w} is stuck in its checkpoint save (past the save's bound); the others waited for it",
}


def explain(run_dir: str) -> Explanation | None:
    """The plain-language explanation of a run directory; None if it holds no dumps."""
    run_dir = pick_job(run_dir)[0]  # a shared run directory: its latest failed job
    run = load_run(run_dir)
    if not run.dumps:
        return None
    culprit, kind, findings = _culprit(run)
    g = {**run.grid.sizes, "ep": run.grid.ep}
    axes = " ".join(f"{a}={g[a]}" for a in ("tp", "cp", "ep", "pp", "dp")
                    if a in g and (a in ("tp", "pp", "dp") or g[a] > 1))
    lines = [f"run {run_dir}: {run.world} ranks, grid {axes}; "
             f"dumps from ranks {sorted(run.dumps)}"]
    if kind == "finished":
        lines.append("no hang: every rank finished (a slow run, if it was slow, was only late)")
    elif culprit is not None:
        lines.append("culprit: " + HEADLINES[kind].format(w=who(run, culprit)))
    else:
        lines.append("culprit: not determined from these dumps")
    lines.append("what each rank was doing:")
    lines += [_rank_line(run, r) for r in range(run.world)]
    if findings:
        lines.append("why:")
        lines += [f"  - {f}" for f in findings]
    faults = {d.get("fault") for d in run.dumps.values() if d.get("fault")}
    if faults:
        lines.append(f"(an injected fault was active: {', '.join(sorted(faults))})")
    if kind in HINTS and culprit is not None:
        lines.append("what to change: " + HINTS[kind].format(c=culprit))
    from mini3d.diagnose.flight_recorder import summary_lines

    lines += summary_lines(run_dir)  # torch's flight recorder, when the ranks left one
    return Explanation("\n".join(lines), culprit, kind, findings)


__all__ = ["explain", "load_run", "Explanation", "Run", "waits_for", "first_divergence",
           "shape_mismatch"]
