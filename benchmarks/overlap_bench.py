"""Measured overlap: how much of the dp gradient sync and of the pipeline's sends / receives ran
while the rank was computing, per layout, next to what the cost model assumes.

    python -m benchmarks.overlap_bench [--quick]

Each layout of `cost_local.LAYOUTS` that has dp or pp traffic trains the tiny model with
collect=["events", "timeline"]; `mini3d.diagnose.overlap.run_overlap` intersects every dp sync
and p2p op's [issue, completion] interval (event log) with the rank's F / B / W actions (timeline)
in the last step, and sums over the ranks: hidden fraction = hidden seconds / in-flight seconds
(the docstring there defines it exactly). The cost model's assumption
(`mini3d.diagnose.overlap.model_overlap`, with this run's calibrated CPU hardware): the dp sync
hides behind the last backward except its exposed part (`dp_exposed` / `dp_total`), p2p not at all.
"""

from __future__ import annotations

import os
import statistics
import sys

from mini3d.diagnose.overlap import model_overlap, run_overlap

from . import cost_local
from .common import value_row
from .train_runs import TINY, measure_train

LAYOUTS = ("dp2", "pp2 1f1b m4", "tp2 pp2 dp2 1f1b m2")
WHAT = {"dp": "dp gradient sync", "pp": "pp send/recv"}


def measure(name: str, steps: int) -> dict:
    """run_overlap of layout `name` (its last step), with the load average it ran under."""
    m = measure_train(TINY, cost_local.LAYOUTS[name], steps=steps, collect=("events", "timeline"))
    return {**run_overlap(m["results"]), "load": os.getloadavg()[0]}


def rows_for(name: str, got: dict, hw) -> list[dict]:
    """One row per kind of traffic the layout has: measured % hidden (per-rank min/median/max)."""
    plan = cost_local.LAYOUTS[name]
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
                 f"{len(ranks)} ranks, last step); load {got['load']:.1f}",
            min=min(ranks, default=0), median=statistics.median(ranks) if ranks else 0,
            max=max(ranks, default=0), measured=o["fraction"], assumed=assumed[kind]))
    return rows


def run(quick: bool = True) -> list[dict]:
    hw = cost_local.FITTED.get(quick)
    if hw is None:  # run alone: calibrate as cost_local does (without its refit)
        from mini3d.cost.calibration import calibrate_machine
        hw = calibrate_machine(quick=quick)
    return [r for name in LAYOUTS for r in rows_for(name, measure(name, 3 if quick else 6), hw)]


if __name__ == "__main__":
    for r in run(quick="--quick" in sys.argv):
        print(r["name"], f"{r['value']:.0f}{r['unit']}", r["note"])
