"""A rank's black box: every op it issues, written through to the run directory as it is begun.

Why. gloo aborts a rank (SIGABRT, from one of its own threads) when a collective's sizes disagree:
that rank cannot dump, and its peers' dumps alone cannot say whether it skipped an op or changed a
shape. Its black box survives it: each op (axis, op, seq, shape, step, action, micro-batch) is one
line `os.write`n to `RUN_DIR/rank{r}.ops{step % 3}` before the op is issued (the kernel has it even
if the process dies the next instant), a retracted op (a fault's skip) is a line saying so, and a
shape a fault changed is written again. The file of a new step is truncated when the step begins, so
the box holds the current step and the two before it: what `history.self_divergence` compares
(the current with the previous, and the previous, complete, with the one before). At the step's
boundary the training loop writes an end line (`end_step`): a rank that skipped the step's *last*
op (a pipeline's loss broadcast) and then waits at the boundary has a complete current step, so the
op missing at its end is a skip, not a rank still working towards it (`ended`).
"""

from __future__ import annotations

import glob
import json
import os
import re


class BlackBox:
    """`CommLog.on_issue` of one rank: appends each op to RUN_DIR/rank{r}.ops{0,1,2}."""

    def __init__(self, run_dir: str, rank: int):
        self.run_dir, self.rank = run_dir, rank
        self.step, self.fd = None, None

    def _file(self, step: int) -> int:
        if step != self.step or self.fd is None:
            self.close()
            path = os.path.join(self.run_dir, f"rank{self.rank}.ops{step % 3}")
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            self.step = step
        return self.fd

    def __call__(self, ev, retracted: bool = False):
        step = (ev.context or {}).get("step")
        if not isinstance(step, int):
            return  # outside the training loop's steps: nothing to compare it with
        rec = {"axis": ev.axis, "op": ev.op, "seq": ev.seq, "group": list(ev.group),
               "shape": list(ev.shape), "peer": ev.peer, "context": dict(ev.context)}
        if ev.splits is not None:  # an all-to-all's (sent, expected) rows per member
            rec["splits"] = [list(ev.splits[0]), list(ev.splits[1])]
        if retracted:
            rec["retracted"] = True
        try:
            os.write(self._file(step), (json.dumps(rec) + "\n").encode())
        except OSError:
            pass  # a full disk must not stop training; the box is only evidence

    def end_step(self, step: int):
        """Step `step`'s ops are all issued: the rank is at the step's boundary."""
        try:
            os.write(self._file(step), (json.dumps({"end_of_step": step}) + "\n").encode())
        except OSError:
            pass

    def close(self):
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None


def read(run_dir: str) -> dict[int, list[dict]]:
    """{rank: the ops of its black box, in issue order, retracted ones removed} (event dicts as in
    a dump: `pending` and `blocked` unknown, so False)."""
    out: dict[int, list[dict]] = {}
    for path in glob.glob(os.path.join(run_dir, "rank*.ops[012]")):
        rank = int(re.findall(r"rank(\d+)\.ops[012]$", path)[0])
        ops: dict[tuple, dict] = {}
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    if "end_of_step" in rec:
                        continue  # (see `ended`)
                    key = (rec["axis"], rec["op"], rec.get("peer"), rec["seq"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by the abort
                ops.pop(key, None)  # retracted, or written again with the shape a fault gave it
                if not rec.get("retracted"):
                    ops[key] = {**rec, "pending": False, "blocked": False}
        out.setdefault(rank, []).extend(ops.values())
    for rank, events in out.items():
        events.sort(key=lambda e: e["context"].get("step", -1))  # stable: issue order in a step
    return out


def ended(run_dir: str) -> dict[int, set[int]]:
    """{rank: the steps its black box records as ended (every op of the step issued)}."""
    out: dict[int, set[int]] = {}
    for path in glob.glob(os.path.join(run_dir, "rank*.ops[012]")):
        rank = int(re.findall(r"rank(\d+)\.ops[012]$", path)[0])
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    step = json.loads(line).get("end_of_step")
                except (ValueError, AttributeError):
                    continue
                if isinstance(step, int):
                    out.setdefault(rank, set()).add(step)
    return out


__all__ = ["BlackBox", "read", "ended"]
