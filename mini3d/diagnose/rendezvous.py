"""Does a set of per-rank communication programs finish? Matching under NCCL's ordering rules.

A program is one rank's ordered list of entries ("issue", id, op) and ("wait", id, op), as recorded
from the real step (`mini3d.run.dryrun`; `id` pairs an op's two entries); a plain op tuple is a
blocking op (issue, then wait). An op is `(kind, key, label)` or `(kind, key, label, batch)`:
`kind` is "coll" (key = (axis, group of world ranks)), "send" or "recv" (key = the peer's world
rank); consecutive issues sharing a `batch` id (not None) are one `batch_isend_irecv` group.
Matching: the k-th collective each member issues on a group (a communicator: axis and ranks) meets
the others' k-th there; the k-th send from a to b meets b's k-th receive from a (as torch and NCCL
do).

`simulate(progs, grid)` uses NCCL's rules (the default, and what `mini3d train --dry-run` uses):

* one stream per pair of ranks (both directions of their point-to-point traffic) and one per
  communicator (a group's collectives): the ops on a stream complete in issue order;
* a send completes only when its matching receive has been posted *and* has reached the head of the
  peer's stream, and vice versa (a send may wait for its receive); a collective completes when the
  matching collective is at the head of every member's stream for that group;
* a batch (`batch_isend_irecv`, one ncclGroup) is one unit on its streams: its ops progress
  together, none queued behind another of the same batch, so two ranks that each batch a send to
  the other with the receive from it (or a ring of such batches) complete;
* issuing a rank's first op toward a peer creates their pair communicator, a blocking join of both
  ranks at issue time (a batch joins all its pairs at once); a cycle of such joins (cp >= 3 ranks
  each sending to the next first) hangs. `device_id=True` says the process group was created with
  `device_id` (eager initialisation, `mini3d.launch.launcher` on CUDA): no join blocks. (A group's
  collective communicator is taken as existing: its lazy creation at a first collective is not
  modelled.)
* a wait blocks the host until its op completes (the strictest reading: on NCCL the host blocks at
  its next synchronisation instead, which is never earlier than the op's completion).

`rules="gloo"` is gloo's reading: issuing never blocks and an op completes once its partners have
issued their matching ops, in any order. `simulate` advances every rank while it can. If all
programs end, no rank waits forever under these rules; otherwise the report names each blocked rank,
its position and what it waits for. A collective whose members disagree on the op (all_reduce meeting
all_gather) is reported too.
"""

from __future__ import annotations

from collections import Counter


def _entries(prog) -> list[tuple]:
    """("issue", [ids], [ops]) for each issue (a batch's consecutive issues merged) or ("wait", id,
    op); a plain op becomes an issue and a wait."""
    out = []
    for i, item in enumerate(prog):
        if item[0] not in ("issue", "wait"):
            item = ("issue", ("b", i), item)
            out.append(("issue", [item[1]], [item[2]]))
            out.append(("wait",) + item[1:])
            continue
        batch = item[2][3] if len(item[2]) > 3 else None
        last = out[-1] if out else None
        if (item[0] == "issue" and batch is not None and last and last[0] == "issue"
                and _batch(last[2][-1]) == batch):
            last[1].append(item[1])
            last[2].append(item[2])
        elif item[0] == "issue":
            out.append(("issue", [item[1]], [item[2]]))
        else:
            out.append(item)
    return out


def _batch(op):
    return op[3] if len(op) > 3 else None


def _match_key(rank: int, op, seen: Counter) -> tuple:
    """The key its partners' ops share (see the module docstring)."""
    kind, key = op[0], op[1]
    if kind == "coll":
        pair = ("coll", key[0], tuple(key[1]))
    else:
        src, dst = (rank, key) if kind == "send" else (key, rank)
        pair = ("p2p", src, dst)
    seen[pair] += 1
    return pair + (seen[pair],)


def _stream(rank: int, op) -> tuple:
    return ("coll", op[1][0], tuple(op[1][1])) if op[0] == "coll" else ("pair", frozenset((rank, op[1])))


class _Sim:
    """The state of one simulation: positions, issued ops, streams, joined pairs, completed ops."""

    def __init__(self, progs, rules: str, device_id: bool):
        self.progs = [_entries(p) for p in progs]
        self.nccl, self.eager = rules == "nccl", device_id or rules != "nccl"
        self.pos = [0] * len(progs)
        self.issued: dict[tuple, dict[int, object]] = {}  # match key -> {rank: op id}
        self.ops: dict[tuple, tuple] = {}  # (rank, op id) -> (op, match key, unit)
        self.streams: dict[tuple, list] = {}  # (rank, stream) -> op ids not yet complete, in order
        self.seen = [Counter() for _ in progs]
        self.joined: set = set()
        self.done: set = set()
        self.open: set = set()  # (rank, op id) issued and not yet complete

    def needs(self, r: int) -> set:
        """Peers rank r must join (pair communicators) to issue its current entry."""
        if self.eager or self.pos[r] >= len(self.progs[r]) or self.progs[r][self.pos[r]][0] != "issue":
            return set()
        peers = {op[1] for op in self.progs[r][self.pos[r]][2] if op[0] != "coll"}
        return {p for p in peers if frozenset((r, p)) not in self.joined}

    def issue(self, r: int, oids, ops):
        unit = tuple(oids)
        for oid, op in zip(oids, ops):
            key = _match_key(r, op, self.seen[r])
            self.issued.setdefault(key, {})[r] = oid
            self.ops[(r, oid)] = (op, key, unit)
            self.open.add((r, oid))
            self.streams.setdefault((r, _stream(r, op)), []).append(oid)

    def advance(self) -> bool:
        moved = False
        for r, prog in enumerate(self.progs):
            while self.pos[r] < len(prog):
                what, oid, op = prog[self.pos[r]]
                if what == "issue" and self.needs(r):
                    break
                if what == "issue":
                    self.issue(r, oid, op)
                elif (r, oid) not in self.done:
                    break
                self.pos[r] += 1
                moved = True
        return moved

    def join(self) -> bool:
        """Ranks at an issue that needs joins, each of whose needed peers waits to join it too."""
        want = {r: self.needs(r) for r in range(len(self.progs))}
        ready = {r for r, w in want.items() if w}
        while True:
            keep = {r for r in ready if all(p in ready and r in want[p] for p in want[r])}
            if keep == ready:
                break
            ready = keep
        for r in ready:
            self.joined.update(frozenset((r, p)) for p in want[r])
        return bool(ready)

    def partners(self, r: int, oid) -> list[tuple] | None:
        """(rank, op id) of every matching op, or None while one is not issued."""
        op, key, _ = self.ops[(r, oid)]
        members = op[1][1] if op[0] == "coll" else (op[1],)
        got = self.issued.get(key, {})
        if not all(m in got for m in members):
            return None
        return [(m, got[m]) for m in members if m != r]

    def at_head(self, r: int, oid) -> bool:
        """Only ops of its own unit (batch) are ahead of it on its stream."""
        op, _, unit = self.ops[(r, oid)]
        queue = self.streams[(r, _stream(r, op))]
        return all(o in unit for o in queue[:queue.index(oid)])

    def ready(self, r: int, oid) -> bool:
        """Every matching op issued (and, under NCCL, it and they at the heads of their streams)."""
        got = self.partners(r, oid)
        if got is None:
            return False
        return not self.nccl or all(self.at_head(m, x) for m, x in [(r, oid)] + got)

    def complete(self) -> bool:
        cand = {(r, oid) for (r, oid) in self.open if self.ready(r, oid)}
        for r, oid in cand:
            self.done.add((r, oid))
            self.open.discard((r, oid))
            self.streams[(r, _stream(r, self.ops[(r, oid)][0]))].remove(oid)
        return bool(cand)

    def run(self):
        while self.advance() | self.join() | self.complete():
            pass


def simulate(progs: list[list], grid=None, rules: str = "nccl", device_id: bool = False) -> str | None:
    """Run the programs; None if all finish, else "deadlock: ..." naming who waits for what.
    `rules`: "nccl" (default) or "gloo"; `device_id`: the process group was created with it (NCCL
    communicators exist up front, so first use joins nothing); `grid` (optional) adds each blocked
    rank's coordinates to the report. See the module docstring."""
    if rules not in ("nccl", "gloo"):
        raise ValueError(f"rules={rules!r} is unknown (choose nccl or gloo)")
    sim = _Sim(progs, rules, device_id)
    sim.run()
    mismatch = _mismatch(sim)
    stuck = [r for r in range(len(sim.progs)) if sim.pos[r] < len(sim.progs[r])]
    if not stuck:
        return mismatch
    parts = [f"rank {r}{f' {grid.coords(r)}' if grid is not None else ''} at op {sim.pos[r]}: "
             f"{_why(sim, r)}" for r in stuck]
    return "deadlock: " + "; ".join(parts) + (f"; {mismatch}" if mismatch else "")


def _what(op) -> str:
    kind, key, label = op[:3]
    if kind == "coll":
        return f"{label} on the {key[0]} group {list(key[1])}"
    return f"{kind} {label} {'to' if kind == 'send' else 'from'} rank {key}"


def _why(sim: _Sim, r: int) -> str:
    what, oid, op = sim.progs[r][sim.pos[r]]
    if what == "issue":
        peers = sorted(sim.needs(r))
        return (f"issuing {', '.join(_what(o) for o in op)} blocks joining the pair communicator "
                f"with rank(s) {peers} (their first point-to-point), which never join it")
    text = f"waits for {_what(op)}"
    head = sim.streams[(r, _stream(r, op))][0]
    if head != oid:
        return text + f", queued behind {_what(sim.ops[(r, head)][0])}"
    got = sim.partners(r, oid)
    if got is None:
        return text + ", whose match is never issued"
    for m, x in got:
        h = sim.streams[(m, _stream(m, sim.ops[(m, x)][0]))][0]
        if h != x:
            return text + f", whose match on rank {m} is queued behind {_what(sim.ops[(m, h)][0])}"
    return text + ", which cannot complete"


def _mismatch(sim: _Sim) -> str | None:
    """A collective whose members issued different ops (by the op name in their labels)."""
    for key, by_rank in sim.issued.items():
        if key[0] != "coll":
            continue
        names = {r: sim.ops[(r, oid)][0][2].split()[0] for r, oid in by_rank.items()}
        if len(set(names.values())) > 1:
            return "mismatch: " + ", ".join(f"rank {r} issues {n}" for r, n in sorted(names.items())) \
                + f" as collective {key[3]} on the {key[1]} group {list(key[2])}"
    return None


__all__ = ["simulate"]
