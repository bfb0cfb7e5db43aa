"""Three findings `explain` looks for in a failed run's dumps: a collective whose members disagree on
its shape (`shape_mismatch`, with the side that departed from its own previous step named), the
first op #k of a group that members issued from different points of the program
(`first_divergence`: the member that skipped one op before it), and an all-to-all whose sender's
split sizes disagree with what its peer expects (`split_mismatch`, from the events' `splits`).
"""

from __future__ import annotations

from mini3d.comm import COLLECTIVES
from mini3d.diagnose.history import diverging_rank
from mini3d.diagnose.run_dir import Run, _event, death, seq_key


def shape_mismatch(run: Run) -> tuple[int, str] | None:
    """(culprit, text) when a blocked collective's shape differs from its group's."""
    for r, d in sorted(run.dumps.items()):
        ev = d.get("blocked")
        if not ev or ev["op"] not in COLLECTIVES or ev["op"] == "all_to_all":
            continue  # an all-to-all's members send different row counts by design
        key, mine = seq_key(ev), tuple(ev["shape"])
        theirs = {m: tuple(e["shape"]) for m in ev["group"] if m != r and m in run.dumps
                  for e in [_event(run.dumps[m], key, ev["seq"])] if e is not None}
        odd = {m: s for m, s in theirs.items() if s != mine}
        if odd:
            m, s = next(iter(odd.items()))
            # which side is wrong: the member whose shape departs from its own previous step
            # (with two members the shapes alone cannot say), else the minority
            found = diverging_rank(run, [r, *odd])
            if found and found[1] == "shape" and found[0] != r:
                r, m, mine, s = found[0], r, s, mine
            return r, (f"shape mismatch in {ev['op']} #{ev['seq']} on the {ev['axis']} group "
                       f"{ev['group']}: rank {r} has {mine}, rank {m} has {s}")
        # members that died cannot tell us their shape: compare with this group's earlier ops
        before = {tuple(e["shape"]) for m in ev["group"] if m in run.dumps
                  for e in run.dumps[m]["events"]
                  if seq_key(e) == key and e["seq"] < ev["seq"] and not e["pending"]}
        dead = [m for m in ev["group"] if m not in run.dumps]
        if dead and before and mine not in before:
            return r, (f"shape mismatch in {ev['op']} #{ev['seq']} on the {ev['axis']} group "
                       f"{ev['group']}: rank {r} sent shape {mine} where every earlier {ev['op']} "
                       f"on this group had {sorted(before)[0]}; rank {dead[0]} {death(run, dead[0])}")
    return None


def first_divergence(run: Run) -> tuple[int, str] | None:
    """(rank that skipped, text): the first op #k of a group that members issued from different
    points of the program (their `context`: step, action, micro-batch). The member whose #k carries
    a context the others reach only at a later #k' skipped one op before it."""
    keys = {}
    for r, d in run.dumps.items():
        for e in d["events"]:
            if e["op"] in COLLECTIVES:
                keys.setdefault((seq_key(e), tuple(e["group"])), {}).setdefault(r, {})[e["seq"]] = e
    for (key, group), by_rank in sorted(keys.items()):
        if len(by_rank) < 2:
            continue
        common = sorted(set.intersection(*(set(v) for v in by_rank.values())))
        for k in common:
            ctx = {r: v[k]["context"] for r, v in by_rank.items()}
            if all(c == next(iter(ctx.values())) for c in ctx.values()):
                continue
            ahead = behind = None
            for a in by_rank:
                for b in by_rank:
                    later = [j for j, e in by_rank[b].items() if j > k and e["context"] == ctx[a]]
                    if a != b and later and ctx[a] != ctx[b]:
                        ahead, behind = a, b
                        break
                if ahead is not None:
                    break
            if ahead is None:  # the later op fell out of the ring buffer: order by step
                steps = {r: c.get("step", -1) for r, c in ctx.items()}
                ahead, behind = max(steps, key=steps.get), min(steps, key=steps.get)
                if steps[ahead] == steps[behind]:
                    continue
            op = key.split("/")[1]
            at = ", ".join(f"{n} {v}" for n, v in ctx[behind].items())
            return ahead, (f"first divergence on the {key.split('/')[0]} group {list(group)}: "
                           f"{op} #{k} came from ({', '.join(f'{n} {v}' for n, v in ctx[ahead].items())})"
                           f" on rank {ahead} but from ({at}) on rank {behind}: rank {ahead} "
                           f"skipped one {op} on this group at {at} or before")
    return None


def _a2a_events(run: Run) -> dict[int, dict[tuple, dict]]:
    """{rank: {(axis, seq): all_to_all event with splits}} from the dumps and the black boxes (a
    rank gloo aborted left only its black box)."""
    out: dict[int, dict[tuple, dict]] = {}
    for r in set(run.dumps) | set(run.issued):
        mine = out.setdefault(r, {})
        for e in run.issued.get(r, []) + (run.dumps[r]["events"] if r in run.dumps else []):
            if e["op"] == "all_to_all" and e.get("splits"):
                mine[(e["axis"], e["seq"])] = e  # the dump's last: it has what was issued
    return out


def split_mismatch(run: Run) -> tuple[int, str] | None:
    """(sender, text) of the first all_to_all in which a member sent a peer another number of rows
    than the peer expected from it (its input split vs the peer's output split). The peer's
    expectation is what the sender announced (mini3d's dispatch exchanges the counts first), so
    the sender is the one that departed from it."""
    events = _a2a_events(run)
    for a, mine in sorted(events.items()):
        for key, e in sorted(mine.items(), key=lambda kv: kv[1]["seq"]):
            group, (ins, _) = list(e["group"]), e["splits"]
            for j, b in enumerate(group):
                theirs = events.get(b, {}).get(key)
                if b == a or theirs is None:
                    continue
                expected = theirs["splits"][1][group.index(a)]
                if ins[j] != expected:
                    ctx = ", ".join(f"{k} {v}" for k, v in (e.get("context") or {}).items())
                    return a, (f"split sizes disagree in all_to_all #{e['seq']} on the {e['axis']} "
                               f"group {group}" + (f" ({ctx})" if ctx else "") + f": rank {a} sent "
                               f"{ins[j]} rows to rank {b}, which expected {expected} from it "
                               f"(rank {a}'s input splits {list(ins)}, rank {b}'s output splits "
                               f"{list(theirs['splits'][1])}: the counts rank {a} announced)")
    return None


__all__ = ["shape_mismatch", "first_divergence", "split_mismatch"]
