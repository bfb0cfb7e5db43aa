"""Do two ranks' point-to-point calls match one for one in issue order? NCCL's rule, checked on every
launched run under MINI3D_CHECK_P2P=1 (tests/conftest.py sets it).

A launch worker records its p2p program (`mini3d.comm_log.P2P_RECORD`: ("issue" | "wait", op key,
(kind, peer, label, batch, shape, dtype)) in program order, all its topologies together) and saves
it in the job's private directory when its function returns; once every rank returned, the launcher
(`check_saved`) loads the records and raises `P2POrderError` naming the ranks, the position and both
ops when

* `pair_mismatch`: for some pair of ranks a, b, the ops a issued toward b (its sends to b and
  receives from b, in issue order: on NCCL they share one stream) and those b issued toward a do
  not match one for one: a's k-th is a send iff b's k-th is a receive, of the same shape and dtype.
  The ops of one batch (`comm.batch_p2p`) progress together, so their order within the batch is
  free: each side's batch is put in one canonical order before the comparison;
* or a registered judge (`add_judge`) reports a problem: `mini3d.diagnose.p2p_order.register`
  adds the full simulation of the programs under NCCL's rules (`mini3d.diagnose.rendezvous`); registered from above, since the diagnostics layer sits above the launcher.
"""

from __future__ import annotations

import os
import pickle

from mini3d.comm_log import CHECK_P2P_ENV, P2P_RECORD, start_p2p_record

JUDGES: list = []  # callables(records) -> problem text or None (see add_judge)


class P2POrderError(RuntimeError):
    """Two ranks' point-to-point programs do not match under NCCL's ordering rules."""


def add_judge(judge):
    """Also run `judge(records)` on every checked job (once per callable)."""
    if judge not in JUDGES:
        JUDGES.append(judge)


def _toward(record, peer: int, mirror: bool = False) -> list[tuple]:
    """(kind, shape, dtype, label, batch) of each op issued toward `peer` (kinds flipped when
    `mirror`: as the peer sees them), each batch in canonical order (sends first, then by shape)."""
    ops = [(_flip(op[0]) if mirror else op[0], tuple(op[4]), op[5], op[2], op[3])
           for what, _, op in record if what == "issue" and op[1] == peer]
    out, i = [], 0
    while i < len(ops):
        j = i + 1
        while ops[i][4] is not None and j < len(ops) and ops[j][4] == ops[i][4]:
            j += 1
        out += sorted(ops[i:j], key=lambda o: (o[0] != "send", o[1], o[2]))
        i = j
    return out


def _flip(kind: str) -> str:
    return "recv" if kind == "send" else "send"


def _show(op) -> str:
    return f"{op[3]} {list(op[1])} {op[2]}" + (" (batched)" if op[4] is not None else "")


def pair_mismatch(records: list) -> str | None:
    """The first pair whose ops toward each other do not match one for one, or None."""
    for a in range(len(records)):
        for b in range(a + 1, len(records)):
            mine, theirs = _toward(records[a], b), _toward(records[b], a, mirror=True)
            for k in range(max(len(mine), len(theirs))):
                x = mine[k] if k < len(mine) else None
                y = theirs[k] if k < len(theirs) else None
                if x is None or y is None or x[:3] != y[:3]:
                    got = "nothing" if y is None else _show((_flip(y[0]),) + y[1:])
                    return (f"point-to-point order: rank {a}'s op {k} toward rank {b} is "
                            f"{'nothing' if x is None else _show(x)}, but rank {b}'s op {k} toward "
                            f"rank {a} is {got} (each send must meet a receive of the same shape and "
                            f"dtype at the same position: NCCL runs a pair's ops in issue order)")
    return None


def checking(env: dict | None = None) -> bool:
    """MINI3D_CHECK_P2P=1 in `env` (a launch's extra environment) or else in this process'."""
    return (env or {}).get(CHECK_P2P_ENV, os.environ.get(CHECK_P2P_ENV, "")) == "1"


def start_worker_record():
    """In a launch worker: record this process' p2p program when checking."""
    if checking():
        start_p2p_record()


def save_worker_record(job_dir: str, rank: int):
    """In a launch worker whose function returned: its record into the job's private directory."""
    if P2P_RECORD.entries is not None:
        with open(os.path.join(job_dir, f"p2p-{rank}.pkl"), "wb") as f:
            pickle.dump(P2P_RECORD.entries, f)


def check_records(records: list) -> None:
    """Raise P2POrderError unless every pair matches one for one and every judge agrees."""
    problem = pair_mismatch(records)
    for judge in JUDGES:
        problem = problem or judge(records)
    if problem:
        raise P2POrderError(f"the ranks' point-to-point programs break NCCL's ordering rules "
                            f"(checked under MINI3D_CHECK_P2P=1): {problem}")


def check_saved(job_dir: str, world_size: int, env: dict | None = None):
    """In the launcher, after every rank returned: check the saved records (when checking)."""
    if not checking(env):
        return
    records = []
    for r in range(world_size):
        with open(os.path.join(job_dir, f"p2p-{r}.pkl"), "rb") as f:
            records.append(pickle.load(f))
    check_records(records)


__all__ = ["P2POrderError", "JUDGES", "add_judge", "pair_mismatch", "checking", "start_worker_record",
           "save_worker_record", "check_records", "check_saved"]
