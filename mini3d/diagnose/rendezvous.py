"""Does a set of per-rank communication programs finish? Rendezvous matching, step by step.

A program is one rank's ordered list of entries ("issue", id, op) and ("wait", id, op), as recorded
from the real step (`mini3d.dryrun`; `id` pairs an op's two entries); a plain `(kind, key, label)`
tuple is a blocking op (issue, then wait).
`kind` is "coll" (key = (axis, group of world ranks)), "send" or "recv" (key = the peer's world
rank). Semantics (the strictest reading of gloo and NCCL):

* issuing never blocks (an async op, or the enqueue of a blocking one);
* a wait blocks until the op completes: a collective when every member of its group has issued its
  matching collective (members match the k-th collective each issues on that group, as torch and
  NCCL do), a send when the peer has issued the matching receive, a receive when the peer has
  issued the matching send (point-to-point ops match in order per pair of ranks).

`simulate` advances every rank while it can. If all programs end, no rank waits forever under these
semantics; otherwise the report names each blocked rank, its position and what it waits for. A
collective whose members disagree on the op (all_reduce meeting all_gather) is reported too.
"""

from __future__ import annotations

from collections import Counter


def _entries(prog) -> list[tuple]:
    out = []
    for i, item in enumerate(prog):
        if item[0] in ("issue", "wait"):
            out.append(item)
        else:  # a blocking op
            out += [("issue", ("b", i), item), ("wait", ("b", i), item)]
    return out


def _match_keys(rank: int, entries) -> dict:
    """op id -> the key its partners' ops share (see the module docstring)."""
    seen, out = Counter(), {}
    for what, oid, op in entries:
        if what != "issue":
            continue
        kind, key = op[0], op[1]
        if kind == "coll":
            pair = ("coll", tuple(key[1]))
        else:
            src, dst = (rank, key) if kind == "send" else (key, rank)
            pair = ("p2p", src, dst)
        seen[pair] += 1
        out[oid] = pair + (seen[pair],)
    return out


def simulate(progs: list[list], grid) -> str | None:
    """Run the programs; None if all finish, else "deadlock: ..." naming who waits for what."""
    progs = [_entries(p) for p in progs]
    keys = [_match_keys(r, p) for r, p in enumerate(progs)]
    issued: dict[tuple, dict[int, tuple]] = {}  # match key -> {rank: op}
    pos = [0] * len(progs)

    def complete(r, oid, op) -> bool:
        members = op[1][1] if op[0] == "coll" else (op[1],)
        return all(m in issued.get(keys[r][oid], {}) for m in members)

    moved = True
    while moved:
        moved = False
        for r, prog in enumerate(progs):
            while pos[r] < len(prog):
                what, oid, op = prog[pos[r]]
                if what == "issue":
                    issued.setdefault(keys[r][oid], {})[r] = op
                elif not complete(r, oid, op):
                    break
                pos[r] += 1
                moved = True
    mismatch = _mismatch(issued)
    stuck = [r for r in range(len(progs)) if pos[r] < len(progs[r])]
    if not stuck:
        return mismatch
    parts = []
    for r in stuck:
        kind, key, label = progs[r][pos[r]][2][:3]
        what = (f"{label} on the {key[0]} group {list(key[1])}" if kind == "coll"
                else f"{kind} {label} {'to' if kind == 'send' else 'from'} rank {key}")
        parts.append(f"rank {r} {grid.coords(r)} at op {pos[r]}: {what}")
    return "deadlock: " + "; ".join(parts) + (f"; {mismatch}" if mismatch else "")


def _mismatch(issued) -> str | None:
    """A collective whose members issued different ops (by the op name in their labels)."""
    for key, by_rank in issued.items():
        if key[0] != "coll":
            continue
        names = {r: op[2].split()[0] for r, op in by_rank.items()}
        if len(set(names.values())) > 1:
            return "mismatch: " + ", ".join(f"rank {r} issues {n}" for r, n in sorted(names.items())) \
                + f" as collective {key[2]} on group {list(key[1])}"
    return None


__all__ = ["simulate"]
