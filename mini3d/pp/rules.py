"""`check(schedule)`: the rules every pipeline schedule must obey, and a proof it cannot deadlock.

Rules, per rank r (an action is "earlier" when it comes before in r's list):

1. placement: every action's stage lives on r (`Schedule.rank_of`), every transfer names the
   right peer;
2. completeness: each F(s, mb) and B(s, mb) appears exactly once, and in a split schedule (one
   with W actions) each W(s, mb) too;
3. inputs: F(s, mb) needs RECV_F(s, mb) earlier (or F(s-1, mb) earlier when s-1 is also on r);
   B(s, mb) needs F(s, mb) earlier and RECV_B(s, mb) earlier (or B(s+1, mb) when s+1 is on r);
   W(s, mb) needs B(s, mb) earlier (B before W);
   SEND_F(s, mb) needs F(s, mb) earlier; SEND_B(s, mb) needs B(s, mb) earlier;
4. matching: every send has exactly one receive at the peer, and vice versa;
5. memory: a micro-batch's activations on a stage live from its F to its last backward action
   (B, or W in a split schedule: W keeps the saved tensors it needs alive); the peak number alive
   on r stays within the schedule's promised bound. `peak_in_flight` reports it per rank, and
   `peak_awaiting_w` how many of those had their B done and wait only for their W.

Deadlock freedom is then shown by executing the lists with *blocking rendezvous* semantics, the
strictest reading of send/recv (a send returns only once the peer's matching receive runs, as for
large messages on gloo and NCCL): compute actions always proceed; a send on r to q and a receive
on q from r proceed together when both are at the head of their lists. If every list runs to the
end, no interleaving of the real run can hang (matching is in order per pair, so the run is
deterministic). If none can move, the report names each blocked rank, its step (index into its
action list) and what it waits for. Like torch and NCCL, send/recv match by order, not content, so
a head-to-head pair whose contents disagree (e.g. sF0.1 meeting rF1.0) is reported as a mismatch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from mini3d.pp.schedules import Action, Schedule


@dataclass
class CheckResult:
    """Outcome of `check`: `ok`, the broken rules, the deadlock (or None) and measured peaks."""

    ok: bool
    problems: list = field(default_factory=list)
    deadlock: str | None = None
    peak_in_flight: list = field(default_factory=list)  # per rank: max activations alive
    rounds: int = 0  # rendezvous rounds the blocking simulation needed
    peak_awaiting_w: list = field(default_factory=list)  # per rank: max alive only for a W

    def __str__(self) -> str:
        if self.ok:
            return (f"OK: rules hold, no deadlock under blocking send/recv ({self.rounds} rounds); "
                    f"peak in-flight micro-batches per rank {self.peak_in_flight}")
        return "FAILED:\n  " + "\n  ".join(self.problems)


def in_flight(s: Schedule) -> tuple[list[int], dict]:
    """(peak per rank, peak per stage) of micro-batch activations alive: from a stage's F to its
    last backward action (W in a split schedule, else B), counted over each rank's compute list.
    Per rank it counts chunk activations (with v chunks per rank, one chunk is 1/v of its layers)."""
    free_at = "W" if s.split else "B"
    ranks, stages = [], {}
    for acts in s.actions:
        live, peak, by_stage = 0, 0, {}
        for a in acts:
            if a.op in ("F", free_at):
                step = 1 if a.op == "F" else -1
                live += step
                by_stage[a.stage] = by_stage.get(a.stage, 0) + step
                stages[a.stage] = max(stages.get(a.stage, 0), by_stage[a.stage])
                peak = max(peak, live)
        ranks.append(peak)
    return ranks, stages


def _rule_problems(s: Schedule) -> tuple[list[str], list[int], list[int]]:
    out, waits = [], []
    S, want, split = s.n_stages, Counter(), s.split
    for st in range(S):
        for mb in range(s.m):
            for op in ("F", "B", "W") if split else ("F", "B"):
                want[(op, st, mb)] += 1
    got = Counter()
    peaks = in_flight(s)[0]
    for r, acts in enumerate(s.actions):
        seen, wait, wait_peak = set(), 0, 0
        for i, a in enumerate(acts):
            where = f"rank {r} step {i} ({a})"
            if not (0 <= a.stage < S and 0 <= a.mb < s.m) or s.rank_of(a.stage) != r:
                out.append(f"{where}: stage {a.stage} / micro-batch {a.mb} is not held by rank {r}")
                continue
            for need in _needs(s, r, a):
                if need not in seen:
                    out.append(f"{where}: needs {need} earlier on rank {r}")
            if not a.is_compute and a.peer != _peer(s, a):
                out.append(f"{where}: peer should be rank {_peer(s, a)}")
            key = (a.op, a.stage, a.mb)
            if key in seen:
                out.append(f"{where}: duplicate")
            seen.add(key)
            if a.is_compute:
                got[key] += 1
                wait += 1 if split and a.op == "B" else -1 if a.op == "W" else 0
                wait_peak = max(wait_peak, wait)
        waits.append(wait_peak)
        peak = peaks[r]
        if s.in_flight_bound and peak > s.in_flight_bound[r]:
            out.append(f"rank {r}: {peak} micro-batches in flight exceeds the bound "
                       f"{s.in_flight_bound[r]}")
    for key in sorted(set(want) | set(got)):
        if got[key] != want[key]:
            out.append(f"{key[0]}{key[1]}.{key[2]} runs {got[key]} times (expected {want[key]})")
    out += _unmatched(s)
    return out, peaks, waits


def _peer(s: Schedule, a: Action) -> int | None:
    nxt = {"SEND_F": 1, "RECV_B": 1, "RECV_F": -1, "SEND_B": -1}.get(a.op)
    if nxt is None or not 0 <= a.stage + nxt < s.n_stages:
        return None
    return s.rank_of(a.stage + nxt)


def _needs(s: Schedule, r: int, a: Action) -> list[tuple]:
    """What must come earlier on rank r before `a` (as (op, stage, mb) keys)."""
    st, mb = a.stage, a.mb
    if a.op == "F":
        if st == 0:
            return []
        return [("F", st - 1, mb)] if s.rank_of(st - 1) == r else [("RECV_F", st, mb)]
    if a.op == "B":
        if st == s.n_stages - 1:
            return [("F", st, mb)]
        nxt = ("B", st + 1, mb) if s.rank_of(st + 1) == r else ("RECV_B", st, mb)
        return [("F", st, mb), nxt]
    if a.op == "W":
        return [("B", st, mb)]
    if a.op == "SEND_F":
        return [("F", st, mb)]
    if a.op == "SEND_B":
        return [("B", st, mb)]
    return []


def _pair_key(r: int, a: Action) -> tuple:
    """Key under which a send and its receive coincide: (src, dst, direction, sender stage, mb)."""
    if a.op == "SEND_F":
        return (r, a.peer, "F", a.stage, a.mb)
    if a.op == "RECV_F":
        return (a.peer, r, "F", a.stage - 1, a.mb)
    if a.op == "SEND_B":
        return (r, a.peer, "B", a.stage, a.mb)
    return (a.peer, r, "B", a.stage + 1, a.mb)


def _unmatched(s: Schedule) -> list[str]:
    sends, recvs = Counter(), Counter()
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.op.startswith("SEND"):
                sends[_pair_key(r, a)] += 1
            elif a.op.startswith("RECV"):
                recvs[_pair_key(r, a)] += 1
    out = []
    for k in sorted(set(sends) | set(recvs), key=str):
        if sends[k] != recvs[k]:
            out.append(f"transfer {k[2]} of stage {k[3]} micro-batch {k[4]} from rank {k[0]} to "
                       f"rank {k[1]}: {sends[k]} send(s) but {recvs[k]} receive(s)")
    return out


def _rendezvous(s: Schedule) -> tuple[str | None, int]:
    """Run the lists with blocking send/recv; (None, rounds) or (description of the hang, rounds)."""
    acts, pos, rounds = s.actions, [0] * s.p, 0
    total = sum(len(a) for a in acts)
    done = 0
    while done < total:
        rounds += 1
        progress = False
        for r in range(s.p):
            while pos[r] < len(acts[r]) and acts[r][pos[r]].is_compute:
                pos[r] += 1
                done += 1
                progress = True
        for r in range(s.p):
            if pos[r] >= len(acts[r]) or not acts[r][pos[r]].op.startswith("SEND"):
                continue
            a = acts[r][pos[r]]
            q = a.peer
            b = acts[q][pos[q]] if q is not None and pos[q] < len(acts[q]) else None
            if b is None or not b.op.startswith("RECV") or b.peer != r:
                continue
            if _pair_key(r, a) != _pair_key(q, b):
                return (f"mismatch: rank {r} step {pos[r]} ({a}) meets rank {q} step {pos[q]} "
                        f"({b}); send/recv match by order, so {b} would get the wrong tensor"), rounds
            pos[r] += 1
            pos[q] += 1
            done += 2
            progress = True
        if not progress:
            return _describe_hang(s, pos), rounds
    return None, rounds


def _describe_hang(s: Schedule, pos: list[int]) -> str:
    parts = []
    for r in range(s.p):
        if pos[r] >= len(s.actions[r]):
            parts.append(f"rank {r} has finished")
            continue
        a = s.actions[r][pos[r]]
        q = a.peer
        there = (f"step {pos[q]} ({s.actions[q][pos[q]]})" if q is not None and
                 pos[q] < len(s.actions[q]) else "its end")
        verb = "sending to" if a.op.startswith("SEND") else "receiving from"
        parts.append(f"rank {r} step {pos[r]} ({a}) blocks {verb} rank {q}, which is at {there}")
    first = min(r for r in range(s.p) if pos[r] < len(s.actions[r]))
    return f"deadlock at rank {first} step {pos[first]}: " + "; ".join(parts)


def check(schedule: Schedule) -> CheckResult:
    """Verify the rules and simulate blocking point-to-point matching (see the module docstring)."""
    problems, peaks, waits = _rule_problems(schedule)
    deadlock, rounds = _rendezvous(schedule)
    if deadlock:
        problems.append(deadlock)
    return CheckResult(not problems, problems, deadlock, peaks, rounds, waits)


__all__ = ["check", "CheckResult", "in_flight"]
