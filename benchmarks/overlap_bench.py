"""Measured overlap: how much of the dp gradient sync and of the pipeline's sends / receives ran
while the rank was computing, per layout, next to what the cost model assumes.

    python -m benchmarks.overlap_bench [--quick] [--repeats N] [--only NAME,...]

Each layout of `cost_local.LAYOUTS` that has dp or pp traffic trains the tiny model with
collect=["events", "timeline"]; `mini3d.diagnose.overlap.run_overlap` intersects every dp sync
and p2p op's [issue, completion] interval (event log) with the rank's F / B / W actions (timeline)
in the last step (on CPU host perf_counter times; on CUDA the GPU's, from timing events: see
`mini3d.timeline_clock`), and sums over the ranks: hidden fraction = hidden seconds / in-flight seconds
(the docstring there defines it exactly). The cost model's assumption
(`mini3d.diagnose.overlap.model_overlap`, with this run's calibrated CPU hardware): the dp sync
hides behind the last backward except its exposed part (`dp_exposed` / `dp_total`), p2p not at all.

The ZeRO-2 / ZeRO-3 layouts (`ZERO_LAYOUTS`) use 128 KiB buckets, so the tiny model's 0.9 MiB of
gradients make several buckets whose reduce-scatters can overlap the rest of the backward
(`mini3d.dp.buckets.GRAD_BUCKETS_IN_FLIGHT` bounds how many are in flight). `--repeats N` measures
each layout N times (fresh launches) and reports the median run, with the N fractions in the note.
"""

from __future__ import annotations

import os
import statistics
import sys

from mini3d.config import Plan
from mini3d.diagnose.overlap import model_overlap, run_overlap

from . import cost_local
from .common import value_row
from .train_runs import TINY, measure_train

ZERO_LAYOUTS = {
    "dp2 zero2 m2": Plan(dp=2, zero=2, micro_batches=2, global_batch=8, seq_len=64, bucket_mb=0.125),
    "dp2 zero3": Plan(dp=2, zero=3, global_batch=8, seq_len=64, bucket_mb=0.125),
}
PLANS = {**cost_local.LAYOUTS, **ZERO_LAYOUTS}
LAYOUTS = ("dp2", "pp2 1f1b m4", "tp2 pp2 dp2 1f1b m2", *ZERO_LAYOUTS)
WHAT = {"dp": "dp gradient sync", "pp": "pp send/recv"}


def measure(name: str, steps: int) -> dict:
    """run_overlap of layout `name` (its last step), with the load average it ran under."""
    m = measure_train(TINY, PLANS[name], steps=steps, collect=("events", "timeline"))
    return {**run_overlap(m["results"]), "load": os.getloadavg()[0]}


def measure_median(name: str, steps: int, repeats: int) -> dict:
    """`measure`, then `repeats - 1` more fresh launches (past measure_train's cache); the run
    with the median dp (else pp) fraction, with every run's fraction under "repeats"."""
    from .train_runs import _measure

    runs = [measure(name, steps)]
    for _ in range(repeats - 1):
        m = _measure(TINY, PLANS[name], steps, 2, 300.0, collect=("events", "timeline"))
        runs.append({**run_overlap(m["results"]), "load": os.getloadavg()[0]})
    kind = "dp" if runs[0]["dp"]["n"] else "pp"
    runs.sort(key=lambda r: r[kind]["fraction"])
    out = runs[len(runs) // 2]
    out["repeats"] = [round(100 * r[kind]["fraction"]) for r in runs]
    return out


def rows_for(name: str, got: dict, hw) -> list[dict]:
    """One row per kind of traffic the layout has: measured % hidden (per-rank min/median/max)."""
    plan = PLANS[name]
    assumed = model_overlap(TINY, plan, hw)
    rows = []
    for kind in ("dp", "pp"):
        if assumed[kind] is None:
            continue
        o = got[kind]
        ranks = [100 * p[kind]["fraction"] for p in got["per_rank"] if p[kind]["n"]]
        rows.append(value_row(
            f"overlap {name}: {WHAT[kind]} hidden behind compute", 100 * o["fraction"], "% hidden",
            note=f"cost model assumes {100 * assumed[kind]:.0f}% hidden; {o['hidden_s'] * 1e3:.1f} "
                 f"of {o['in_flight_s'] * 1e3:.1f} ms in flight hidden ({o['n']} ops, "
                 f"{len(ranks)} ranks, last step); load {got['load']:.1f}"
                 + (f"; median of runs {got['repeats']} %" if len(got.get("repeats", ())) > 1 else ""),
            min=min(ranks, default=0), median=statistics.median(ranks) if ranks else 0,
            max=max(ranks, default=0), measured=o["fraction"], assumed=assumed[kind]))
    return rows


def run(quick: bool = True, repeats: int = 1, only=None) -> list[dict]:
    hw = cost_local.FITTED.get(quick)
    if hw is None:  # run alone: calibrate as cost_local does (without its refit)
        from mini3d.cost.calibration import calibrate_machine
        hw = calibrate_machine(quick=quick)
    steps = 3 if quick else 6
    return [r for name in (only or LAYOUTS)
            for r in rows_for(name, measure_median(name, steps, repeats), hw)]


def _arg(flag: str, default):
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default


if __name__ == "__main__":
    names = _arg("--only", None)
    for r in run(quick="--quick" in sys.argv, repeats=int(_arg("--repeats", 1)),
                 only=names.split(",") if names else None):
        print(r["name"], f"{r['value']:.0f}{r['unit']}", r["note"])
