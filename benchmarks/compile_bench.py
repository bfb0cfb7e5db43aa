"""Compiled / eager: `mini3d train --compile` (inductor, each block compiled, mini3d.run.compile) against
the same run in eager mode, one process and tp2, on local CPU processes.

Each side is a real `mini3d.run.train.train_worker` launch (the CLI's worker) of the tiny model; the
steps are timed by the trainer's own step records. The first `WARMUP` steps are left out of the
timed ones: the compiled run's first step traces and compiles (inductor writes C++ and builds it
with the system compiler), which costs seconds to minutes and is reported on its own: the warm-up
row's value is the compiled run's first steps minus as many of its timed median steps. Inductor
keeps what it built in an on-disk cache, so a second run on the same machine pays less (the note
says which the row saw: cold or warm is whatever this machine's cache held).

The two launches run one after the other (not step by step interleaved), so a change of load
between them shows in the ratio; read the spread. On the shared 2-core machine where this was
written (load average 9-10) the quick rows ranged over runs from 0.66 to 0.96 (one process) and
from 0.73 to 1.26 (tp2): on a CPU, compile is no reliable win at this size, and with tp it can lose.
"""

from __future__ import annotations

import statistics
import time

from mini3d.config import PRESETS, Plan
from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec, reporter_records, train_worker

from .common import ratio_row, value_row

TINY = PRESETS["tiny"]
WARMUP = 2  # untimed steps: the compiled run compiles in the first (recompiles, if any, in the second)
LAYOUTS = (("one process", Plan(global_batch=8, seq_len=64)),
           ("tp2", Plan(tp=2, global_batch=8, seq_len=64)))


def step_times(plan: Plan, steps: int, timeout: float = 600.0) -> dict:
    """The reporting rank's step times: the `WARMUP` first ones and the `steps` timed ones, and
    the launch's wall time."""
    spec = make_spec(TINY, plan, steps=steps + WARMUP, seed=0)
    t0 = time.perf_counter()
    results = launch(train_worker, plan.world_size, spec, device="cpu", timeout=timeout)
    times = [r["step_time_s"] for r in reporter_records(results)]
    return {"warmup": times[:WARMUP], "timed": times[WARMUP:], "wall_s": time.perf_counter() - t0}


def _layout_rows(label: str, plan: Plan, steps: int) -> list[dict]:
    eager = step_times(plan, steps)
    compiled = step_times(plan.replace(compile="inductor"), steps)
    median = statistics.median(compiled["timed"])
    warm_up = sum(compiled["warmup"]) - WARMUP * median
    ratio = ratio_row(f"compiled / eager, {label} (tiny, inductor, 8x64 tokens/step)",
                      compiled["timed"], eager["timed"])
    verdict = ("compile does not pay here" if ratio["ratio"] > 1.05 else
               "compile is level here (does not pay)" if ratio["ratio"] >= 0.95 else "compile pays here")
    ratio["note"] = f"{verdict}: {NOTES[label]}"
    warm = value_row(f"compile warm-up, {label}", warm_up, "s", note=(
        f"first {WARMUP} compiled steps minus {WARMUP} timed steps, not in the ratio above "
        f"(launch wall time {compiled['wall_s']:.0f} s compiled, {eager['wall_s']:.0f} s eager)"))
    return [ratio, warm]


NOTES = {  # why, on a CPU; the verdict before it is computed from the ratio
    "one process": "the tiny model's CPU step is small matmuls (unchanged by compile) plus per-op "
                   "overhead and elementwise ops, which compile removes and fuses",
    "tp2": "each block's graph breaks at its 4 tp collectives (kept eager): 5 small graphs per "
           "block, each with guards and a launch; 2 processes share the cores, so load swings it",
}


def run(quick: bool = True) -> list[dict]:
    """Two ratio rows (one process, tp2) and the compile warm-up of each."""
    steps = 4 if quick else 10
    rows = []
    for label, plan in LAYOUTS:
        rows += _layout_rows(label, plan, steps)
    return rows
