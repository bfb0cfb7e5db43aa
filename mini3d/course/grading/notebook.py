"""The grade cell that ends every chapter: grade the learner's file in exercises/ from inside the lab.

    grade_exercise("ring_allreduce")

prints one line per check with its points, pass or fail (and why it failed: the stub's own hint
while the exercise is unfinished), and the exercise's score. It never raises, so a chapter run
top to bottom (or headless in CI, where exercises/ holds the stubs) always reaches its end. Each
call re-imports the learner's module and reruns its multi-process scenario, so a file edited since
the last run is graded as it is now.
"""

from __future__ import annotations

import random
import sys

from mini3d.course.grading import runner
from mini3d.course.grading.runner import check_lines, find, run_check


def _forget(impl: str, names) -> None:
    """Drop cached imports and scenario results of `impl`, so edited files are graded anew."""
    for mod in [m for m in sys.modules if m == impl or m.startswith(impl + ".")]:
        del sys.modules[mod]
    for key in [k for k in runner._scenario_cache if k[0] in names and k[1] == impl]:
        del runner._scenario_cache[key]


def grade_exercise(*names: str, impl: str = "exercises", seed: int | None = None) -> None:
    """Grade the named exercises (from exercises/, the learner's answers, by default) and print,
    per exercise, its score and one line per check. The seed is printed so a failure can be
    replayed with `python -m mini3d grade --seed N NAME`."""
    seed = random.SystemRandom().randrange(10**6) if seed is None else int(seed)
    try:
        exs = find(names)
    except KeyError as e:  # a typo in the cell: say so instead of raising
        print(f"cannot grade: {e.args[0]}")
        return
    _forget(impl, [e.name for e in exs])
    for ex in exs:
        outs = [run_check(ex, c, impl, seed) for c in ex.checks]
        got = sum(o.earned for o in outs)
        print(f"{ex.name} (chapter {ex.chapter}): {got}/{ex.points} points "
              f"[{impl}/{ex.name}.py, seed {seed}: `python -m mini3d grade --seed {seed} {ex.name}` replays it]")
        print("\n".join(check_lines(ex, outs)))


__all__ = ["grade_exercise"]
