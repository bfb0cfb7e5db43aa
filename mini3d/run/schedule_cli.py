"""`mini3d schedule`: print a pipeline schedule as a grid, its rule check and its simulated bubble.

    mini3d schedule --pp 4 --micro-batches 8 --schedule 1f1b
    mini3d schedule --pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2 --json
    mini3d schedule --pp 4 --micro-batches 8 --schedule zb-h1

Forward and backward are costed 1 and 2 units per full-model slice (a backward computes two
matmuls per forward matmul); split schedules (zb-h1, zbv) cost B (input gradient) and W (weight
gradients) 1 unit each; with v chunks per rank each chunk costs 1/v of that. The grid itself
draws every action one unit wide. The four schedule flags are `Plan`'s, built by mini3d.run.flags
(help from the field docstrings); an omitted --virtual-stages is the kind's default v.
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction

from mini3d.config import Plan
from mini3d.exits import EXIT_BAD_INPUT
from mini3d.pp.rules import check
from mini3d.pp.schedules import make_schedule, schedule_problems
from mini3d.pp.simulator import bubble_formula, simulate
from mini3d.run.flags import add_plan_flags, flag_fields
from mini3d.schedule_kinds import KINDS as KINDS_BY_NAME

FLAGS = ("pp", "micro_batches", "schedule", "virtual_stages")  # the Plan fields this command reads


def register(subparsers):
    """Add the `schedule` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser("schedule", help="print, check and time a pipeline schedule",
                              description=__doc__.split("\n\n")[0])
    add_plan_flags(p, skip={f.name for f in flag_fields(Plan)} - set(FLAGS),
                   given_only={"virtual_stages": "the kind's: interleaved, looped-bfs, zbv 2; else 1"})
    p.add_argument("--transfers", action="store_true", help="list every rank's sends/receives too")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
    return p


MAX_CELLS = 50_000  # pp x micro-batches x v: the grid, check and simulation take seconds at this


def run(args) -> int:
    kind = KINDS_BY_NAME.get(args.schedule)  # unknown: schedule_problems names it below
    v = args.virtual_stages or (kind.default_v if kind else 1)
    problems = schedule_problems(args.schedule, args.pp, args.micro_batches, v)
    if not problems and args.pp * args.micro_batches * v > MAX_CELLS:
        problems.append(f"pp x micro-batches x virtual-stages = {args.pp} x {args.micro_batches} x "
                        f"{v} = {args.pp * args.micro_batches * v:,} exceeds the bound of "
                        f"{MAX_CELLS:,} (a schedule to print and simulate)")
    if problems:
        print(f"mini3d schedule: bad input (--pp {args.pp} --micro-batches {args.micro_batches} "
              f"--schedule {args.schedule} --virtual-stages {v}): " + "; ".join(problems) + ".",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    sched = make_schedule(args.schedule, args.pp, args.micro_batches, v)
    result = check(sched)
    sim = simulate(sched, Fraction(1, v), Fraction(2, v))  # split: t_w = half the backward
    formula = bubble_formula(args.schedule, args.pp, args.micro_batches, v)
    base = None  # 1F1B's bubble at the same p, m, for the split schedules
    if sched.split and not schedule_problems("1f1b", args.pp, args.micro_batches):
        base = simulate(make_schedule("1f1b", args.pp, args.micro_batches), 1, 2).bubble_fraction
    if args.json:
        print(json.dumps({"schedule": sched.to_dict(), "check": {
            "ok": result.ok, "problems": result.problems,
            "peak_in_flight": result.peak_in_flight, "peak_awaiting_w": result.peak_awaiting_w},
            "bubble_fraction": float(sim.bubble_fraction),
            "bubble_formula": None if formula is None else float(formula),
            "bubble_1f1b": None if base is None else float(base),
            "makespan_units": float(sim.makespan)}, indent=1))
    else:
        print(sched.format_grid(transfers=args.transfers))
        print(f"check: {result}")
        costs = "t_fwd=1, t_bwd=2 per full slice" + (" (B=1, W=1)" if sched.split else "")
        closed = "no closed form" if formula is None else f"closed form {formula} = {float(formula):.4f}"
        print(f"simulated bubble fraction {float(sim.bubble_fraction):.4f} ({closed}; {costs})")
        if base is not None:
            print(f"1f1b at the same pp, micro-batches: bubble fraction {float(base):.4f}")
    return 0 if result.ok else 1


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="mini3d")
    register(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
