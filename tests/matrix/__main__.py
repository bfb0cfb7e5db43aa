"""`python -m tests.matrix [--random N --seed S] [--show] [--data DIR]`

Without --random: the covering array (every pair of option values; tests/matrix/pairwise.py), its
valid cases run against their one-process references and its exit-2 cases checked. With --random N:
N further valid combinations drawn with seed S (pp=4 and float32 too: tests/matrix RANDOM_DIMS).
One line per case (PASS / FAIL, the worst deviation against its bound, the `mini3d train` flags
that reproduce it), then a summary; exit status 0 only if every case passed. --show prints the
cases' flags without running them. The data directory is made once (tests/matrix/run.py).
"""

from __future__ import annotations

import argparse
import sys
import time

from . import RANDOM_DIMS, describe, expected_messages, flags
from .pairwise import covering_array, random_valid_cases
from .run import check_exit2, prepare_data, run_matrix


def _line(verdict: dict) -> str:
    status = "PASS" if verdict["ok"] else "FAIL"
    dev = (f"{verdict['metric']} {verdict['dev']:.2e} (bound {verdict['bound']:.0e})"
           if verdict["metric"] != "error" else "error")
    text = f"{status} {verdict['name']}: worst {dev}"
    if not verdict["ok"]:
        text += f"\n     {verdict['message'][:400]}"
    return text + "\n     mini3d train " + " ".join(verdict["flags"])


def cpu_seconds() -> float:
    """CPU time of this process and its ended children (the ranks): what a busy shared machine
    does not inflate, unlike the wall clock."""
    import resource

    own, ranks = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + ranks.ru_utime + ranks.ru_stime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.matrix", description=__doc__.splitlines()[0])
    p.add_argument("--random", type=int, default=0, metavar="N", help="N random valid cases")
    p.add_argument("--seed", type=int, default=1, help="the random cases' seed")
    p.add_argument("--show", action="store_true", help="print the cases' flags, run nothing")
    p.add_argument("--data", help="a `mini3d prepare` directory with a val split (default: made once)")
    args = p.parse_args(argv)
    data = args.data or prepare_data()
    if args.random:
        valid, exit2 = random_valid_cases(args.random, args.seed, RANDOM_DIMS), []
    else:
        valid, exit2 = covering_array()
    if args.show:
        for c in valid + exit2:
            print(f"{'exit-2 ' if c in exit2 else ''}{describe(c)}: mini3d train {' '.join(flags(c, data))}")
        return 0
    t0, failed = time.perf_counter(), 0
    for c in exit2:
        ok, message = check_exit2(c, data, expected_messages(c))
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} exit-2 {describe(c)}: {message[:300]}", flush=True)
    verdicts = run_matrix(valid, data, report=lambda v: print(_line(v), flush=True))
    failed += sum(not v["ok"] for v in verdicts)
    dt, cpu = time.perf_counter() - t0, cpu_seconds()
    print(f"{len(valid)} valid cases, {len(exit2)} exit-2 cases: {failed} failed, "
          f"{len(valid) + len(exit2) - failed} passed in {dt:.0f} s ({cpu:.0f} CPU s: about "
          f"{cpu / 2:.0f} s on two idle cores)", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
