"""`mini3d explain-hang DIR`: explain a hang or failure from the per-rank dumps in DIR."""

from __future__ import annotations

import os
import sys


def cmd_explain_hang(args) -> int:
    from .explain import explain

    if not os.path.isdir(args.dir):
        print(f"mini3d explain-hang: bad input: DIR={args.dir!r} is not a directory", file=sys.stderr)
        return 2
    result = explain(args.dir)
    if result is None:
        print(f"mini3d explain-hang: bad input: DIR={args.dir!r} holds no rank*.json dumps (pass the "
              f"--run-dir of the failed job)", file=sys.stderr)
        return 2
    print(result.text)
    return 0


def register(subparsers):
    p = subparsers.add_parser("explain-hang", help="explain a hang from the per-rank dumps",
                              description="Merge the rank*.json dumps that the hang watchdog wrote "
                                          "and say which rank, axis, micro-batch and op went wrong.")
    p.add_argument("dir", metavar="DIR", help="the run directory (mini3d train --run-dir)")
    p.set_defaults(func=cmd_explain_hang)


__all__ = ["register", "cmd_explain_hang"]
