"""`mini3d schedule`: print a pipeline schedule as a grid, its rule check and its simulated bubble.

    mini3d schedule --pp 4 --micro-batches 8 --schedule 1f1b
    mini3d schedule --pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2 --json

Forward and backward are costed 1 and 2 units per full-model slice (a backward computes two
matmuls per forward matmul); for the interleaved schedule each chunk costs 1/v of that.
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction

from .rules import check
from .schedules import KINDS, make_schedule, schedule_problems
from .simulator import bubble_formula, simulate


def register(subparsers):
    """Add the `schedule` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser("schedule", help="print, check and time a pipeline schedule",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks p")
    p.add_argument("--micro-batches", type=int, required=True, help="micro-batches m per step")
    p.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(KINDS)}")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="model chunks per rank v (interleaved only; default 2 there, else 1)")
    p.add_argument("--transfers", action="store_true", help="list every rank's sends/receives too")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    v = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
    problems = schedule_problems(args.schedule, args.pp, args.micro_batches, v)
    if problems:
        print(f"mini3d schedule: bad input (--pp {args.pp} --micro-batches {args.micro_batches} "
              f"--schedule {args.schedule} --virtual-stages {v}): " + "; ".join(problems) + ".",
              file=sys.stderr)
        return 2
    sched = make_schedule(args.schedule, args.pp, args.micro_batches, v)
    result = check(sched)
    sim = simulate(sched, Fraction(1, v), Fraction(2, v))
    formula = bubble_formula(args.schedule, args.pp, args.micro_batches, v)
    if args.json:
        print(json.dumps({"schedule": sched.to_dict(), "check": {
            "ok": result.ok, "problems": result.problems,
            "peak_in_flight": result.peak_in_flight},
            "bubble_fraction": float(sim.bubble_fraction), "bubble_formula": float(formula),
            "makespan_units": float(sim.makespan)}, indent=1))
    else:
        print(sched.format_grid(transfers=args.transfers))
        print(f"check: {result}")
        print(f"simulated bubble fraction {float(sim.bubble_fraction):.4f} "
              f"(closed form {formula} = {float(formula):.4f}; t_fwd=1, t_bwd=2 per full slice)")
    return 0 if result.ok else 1


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="mini3d")
    register(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
