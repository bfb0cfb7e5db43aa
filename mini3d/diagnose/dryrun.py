"""`mini3d train --dry-run`: check a plan end to end without starting a single process.

1. validate the plan (the caller exits 2 with the reasons when it is broken);
2. print the rank map (`Grid.describe`, node boundaries with `--gpus-per-node`);
3. prove one step's communication cannot deadlock: build every rank's ordered list of blocking
   comm ops (the pipeline's sends/receives from `mini3d.pp.schedules`, tp collectives inside each
   forward/backward, the dp gradient sync and the loss all-reduce after the last micro-batch) and
   execute the lists with rendezvous semantics (a collective completes when every member of its group
   is at it; a send when its peer is at the matching recv). If every list runs to the end, no
   interleaving of the real step can hang;
4. print the memory estimate per pipeline stage (`mini3d.cost.memory`) and the bubble.

The proof runs on a reduced grid, tp and dp capped at 2: every tp group and every dp replica runs
the same program, so two members show every cross-group interaction that more would.
"""

from __future__ import annotations

from ..grid import Grid
from ..pp.partition import partition_layers

CAP = 2  # tp and dp members kept for the deadlock proof (see the module docstring)


def pipeline_actions(plan) -> tuple[list, str]:
    """Per-pipeline-rank action lists from mini3d.pp.schedules (with a note on where they came from)."""
    try:
        from ..pp.rules import check
        from ..pp.schedules import make_schedule
    except ImportError:
        if plan.pp > 1:
            return None, "mini3d.pp.schedules is not available in this tree: pipeline p2p not checked"
        check = make_schedule = None
    if plan.pp == 1 or make_schedule is None:
        acts = [[("F", 0, mb, None) for mb in range(plan.micro_batches)]
                + [("B", 0, mb, None) for mb in range(plan.micro_batches)]]
        return acts, "pp=1: no pipeline transfers"
    s = make_schedule(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages)
    result = check(s)
    note = f"schedule {plan.schedule}: mini3d.pp.rules.check " + (
        "passed" if result.ok else "FAILED: " + "; ".join(result.problems))
    return [[tuple(a) for a in s.actions[r]] for r in range(plan.pp)], note


def rank_programs(cfg, plan, grid: Grid, actions) -> list[list[tuple]]:
    """Every rank's ordered blocking comm ops for one step: (kind, key, label).

    kind is "coll" (key = (axis, group)), "send" or "recv" (key = peer world rank)."""
    n_chunks = plan.pp * plan.virtual_stages
    layers = [len(ids) for ids in partition_layers(cfg.n_layers, plan.pp, plan.virtual_stages)]
    tp_ops = 4 if plan.sequence_parallel else 2  # per layer: 2 all-reduces, or 2 AG + 2 RS
    progs = []
    for r in range(grid.world_size):
        c = grid.coords(r)
        tp_g, dp_g, pp_g = (tuple(grid.group_of(r, a)) for a in ("tp", "dp", "pp"))
        prog = []
        for op, stage, mb, peer in actions[c["pp"]]:
            label = f"{op}{stage}.{mb}"
            if op in ("F", "B") and grid.sizes["tp"] > 1:
                n = tp_ops * layers[stage] + (1 if stage in (0, n_chunks - 1) else 0)
                prog.append(("coll", ("tp", tp_g), f"{label}: {n} tp collectives"))
            elif op.startswith("SEND"):
                prog.append(("send", pp_g[peer], label))
            elif op.startswith("RECV"):
                prog.append(("recv", pp_g[peer], label))
        if grid.sizes["dp"] > 1:
            sync = "reduce_scatter + all_gather" if plan.zero >= 2 else "all_reduce"
            prog.append(("coll", ("dp", dp_g), f"gradient {sync}"))
            if c["pp"] == plan.pp - 1:
                prog.append(("coll", ("dp", dp_g), "loss all_reduce"))
        progs.append(prog)
    return progs


def simulate(progs: list[list[tuple]], grid: Grid) -> str | None:
    """Run the programs with rendezvous semantics; None if all finish, else who waits for what."""
    pos = [0] * len(progs)
    head = lambda r: progs[r][pos[r]] if pos[r] < len(progs[r]) else None  # noqa: E731
    moved = True
    while moved:
        moved = False
        for r in range(len(progs)):
            op = head(r)
            if op is None:
                continue
            kind, key, _ = op
            if kind == "coll":
                members = key[1]
                if all(head(m) is not None and head(m)[:2] == op[:2] for m in members):
                    for m in members:
                        pos[m] += 1
                    moved = True
            elif kind == "send":
                peer = head(key)
                if peer is not None and peer[0] == "recv" and peer[1] == r:
                    pos[r] += 1
                    pos[key] += 1
                    moved = True
    stuck = [r for r in range(len(progs)) if head(r) is not None]
    if not stuck:
        return None
    parts = []
    for r in stuck:
        kind, key, label = head(r)
        what = (f"{label} on the {key[0]} group {list(key[1])}" if kind == "coll"
                else f"{kind} {label} {'to' if kind == 'send' else 'from'} rank {key}")
        parts.append(f"rank {r} {grid.coords(r)} at op {pos[r]}: {what}")
    return "deadlock: " + "; ".join(parts)


def memory_lines(cfg, plan) -> list[str]:
    try:
        from ..cost.memory import estimate_memory
    except ImportError:
        return ["memory: mini3d.cost.memory is not available in this tree"]
    def size(n):
        return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 2**20:,.1f} MiB"

    cats = ("params", "grads", "optimizer", "activations", "comm_buffers")
    lines = []
    for s in range(plan.pp):
        e = estimate_memory(cfg, plan, s)
        parts = ", ".join(f"{c} {size(getattr(e, c))}" for c in cats)
        lines.append(f"memory per rank, stage {s} (estimate): {size(e.total)} ({parts})")
    return lines


def bubble_line(plan) -> str:
    from ..pp.simulator import bubble_formula

    p, m, v = plan.pp, plan.micro_batches, plan.virtual_stages
    b = bubble_formula(plan.schedule, p, m, v)
    if b is None:  # zbv: no closed form, the simulated bubble with t_F = 1, t_bwd = 2 per stage
        from ..pp.schedules import make_schedule
        from ..pp.simulator import simulate

        b = simulate(make_schedule(plan.schedule, p, m, v), 1 / v, 2 / v).bubble_fraction
        return f"pipeline bubble ({plan.schedule}, simulated): {float(b):.1%}"
    if plan.schedule == "zb-h1":
        return (f"pipeline bubble (zb-h1, t_F = t_B = t_W): (p-1)/(3m+p-1) = "
                f"{b.numerator}/{b.denominator} = {float(b):.1%}")
    return (f"pipeline bubble: (p-1)/({'v*m' if v > 1 else 'm'}+p-1) = {b.numerator}/{b.denominator}"
            f" = {float(b):.1%}")


def dry_run(cfg, plan, gpus_per_node: int | None = None, out=print) -> int:
    """Print the map, the deadlock proof, memory and bubble for a validated plan; returns 0 or 1."""
    grid = Grid(plan.tp, plan.pp, plan.dp, cp=plan.cp)
    cp = f"cp={plan.cp} " if plan.cp > 1 else ""
    out(f"dry run: {cfg.name} ({cfg.n_params() / 1e6:,.1f} M parameters) on tp={plan.tp} "
        f"{cp}pp={plan.pp} dp={plan.dp} ({plan.world_size} ranks); plan is valid")
    out(grid.describe(gpus_per_node))
    actions, note = pipeline_actions(plan)
    out(note)
    status = 0
    if actions is not None:
        small = Grid(min(plan.tp, CAP), plan.pp, min(plan.dp, CAP))
        progs = rank_programs(cfg, plan, small, actions)
        hang = simulate(progs, small)
        n = sum(len(p) for p in progs)
        if hang:
            out(f"communication: {hang}")
            status = 1
        else:
            out(f"communication: deadlock-free: {n} blocking ops on a tp={small.sizes['tp']} "
                f"pp={plan.pp} dp={small.sizes['dp']} slice (every tp/dp member runs the same "
                f"program) all complete under rendezvous matching")
    for line in memory_lines(cfg, plan):
        out(line)
    out(bubble_line(plan))
    out("nothing was started (dry run)")
    return status


__all__ = ["dry_run", "rank_programs", "simulate", "pipeline_actions"]
