"""`mini3d grade`: grade the exercises (or the reference solutions) and print a score table.

`mini3d.cli` forwards the command line here when the command is `grade`, so the engine's CLI
imports nothing of the course until a learner grades.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import sys

from mini3d.exits import bad_input

from mini3d.course.grading.core import ensure_importable
from mini3d.course.grading.runner import find, grade, score_table


def cmd_grade(args) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    try:
        find(args.exercise)
    except KeyError as e:
        return bad_input([e.args[0]], "grade", after="")
    impl = args.impl
    try:
        ensure_importable()
        importlib.import_module(impl)
    except ImportError:
        return bad_input([f"--impl {impl!r} is not importable from {os.getcwd()} (run from the "
                          f"repository root, which holds exercises/ and solutions/)"], "grade", after="")
    print(f"grading {impl} with seed {seed} (rerun with --seed {seed} to reproduce)", flush=True)
    outcomes = grade(impl, args.exercise, seed)
    print(score_table(outcomes, seed))
    return 0 if all(o.earned for o in outcomes) else 1


HELP = "grade the exercises (or the reference solutions)"
DESCRIPTION = ("Run each exercise's checks and print points per exercise with the first failing "
               "check in words. Exit 0 when all pass, 1 when some fail, 2 for bad input.")


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("exercise", nargs="*", help="exercise names (default: all)")
    p.add_argument("--impl", default="exercises",
                   help="exercises (your answers, default), solutions, or a package path")
    p.add_argument("--seed", type=int, help="grading seed (default: random, printed)")


def main(argv) -> int:
    """`mini3d grade ARGV...`: parse the grade command's own arguments and run it."""
    p = argparse.ArgumentParser(prog="mini3d grade", description=DESCRIPTION)
    add_arguments(p)
    return cmd_grade(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
