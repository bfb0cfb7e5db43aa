"""The cost model's predicted step time against measured `mini3d train` runs on this CPU machine.

    python -m benchmarks.cost_local [--quick]          (also under `taskset -c 0`: one core)

1. Calibrate this machine with `mini3d.cost.calibration.calibrate_machine` (matmul rate and its
   width dependence, memory bandwidth, gloo all-reduce latency and bandwidth, per-layer overhead;
   the cores are the process' CPU affinity, so `taskset` makes a smaller machine).
2. Refit one number on one run: `layer_overhead_s`, from the fastest measured single-process step
   of the tiny model (what a real step also pays per layer: the optimizer's per-tensor work,
   hooks, the head and loss spread over the layers; step time is linear in it).
3. For each layout (dp2, tp2, pp2, tp2 pp2 dp2), the same processes that will train first run the
   host probe (`mini3d.cost.host_probe`: busy Block units; units paced by pair all-reduces through
   mini3d.comm, as a tp step issues them; a two-stage ping-pong of p2p messages), train, and run
   the probe again, so it brackets the measured steps and sees the load they saw, with the
   layout's own process count (8 processes on 2 cores for the 3D layout, never extrapolated from
   2). It measures CPU seconds (every thread's) as well as wall seconds: what each all-reduce and
   each message end costs in CPU, what it waits beyond that, and how much more CPU a unit takes
   among these processes than alone. The prediction simulates the step under processor sharing
   of the cores (`mini3d.cost.host_share`) with those numbers.
   A row's ratio is measured / predicted
   per timed step (min/median/max); goal 0.7 - 1.3. The note gives the probe's numbers and the
   load average (1 minute, mean of before and after) the row ran under.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from mini3d.config import ModelConfig, Plan
from mini3d.cost.calibration import calibrate_machine
from mini3d.cost.hardware import Hardware
from mini3d.cost.host_probe import probed_hardware
from mini3d.cost.model import predict_step_time

from .common import stats
from .train_runs import TINY, measure_train

FIT_PLAN = Plan(micro_batches=2, global_batch=8, seq_len=64)  # micro-batches of 4 x 64 tokens
LAYOUTS = {
    "dp2": Plan(dp=2, global_batch=8, seq_len=64),
    "tp2": Plan(tp=2, global_batch=8, seq_len=64),
    "pp2 1f1b m4": Plan(pp=2, micro_batches=4, global_batch=8, seq_len=64),
    "tp2 pp2 dp2 1f1b m2": Plan(tp=2, pp=2, dp=2, micro_batches=2, global_batch=8, seq_len=64),
}
QUICK_LAYOUTS = ("dp2", "tp2", "pp2 1f1b m4")


def fit_layer_overhead(cfg: ModelConfig, plan: Plan, hw: Hardware, measured_s: float) -> Hardware:
    """`hw` with `layer_overhead_s` chosen so that the prediction for `plan` equals `measured_s`.

    The predicted step time is affine in layer_overhead_s (it adds per layer and micro-batch, scaled
    by the oversubscription factor; the pipeline bubble's share follows it linearly too when p = 1),
    so two evaluations give the line and one division its root (clamped at 0)."""
    t0 = predict_step_time(cfg, plan, dataclasses.replace(hw, layer_overhead_s=0.0))
    t1 = predict_step_time(cfg, plan, dataclasses.replace(hw, layer_overhead_s=1e-3))
    slope = (t1 - t0) / 1e-3
    return dataclasses.replace(hw, layer_overhead_s=max(0.0, (measured_s - t0) / slope))


FITTED: dict = {}  # quick -> the refitted hardware of the latest `run` (overlap_bench reads it)
PROBE_UNITS = 40  # host-probe units each rank runs around its training steps (half before, half after)


def compare(cfg: ModelConfig, plan: Plan, hw: Hardware, steps: int, reference_s: float) -> dict:
    """Measure `plan` right after a host probe in the same processes (the layout's own process
    count), and compare each timed step with the prediction made with what the probe saw."""
    load = os.getloadavg()[0]
    m = measure_train(cfg, plan, steps=steps, probe=PROBE_UNITS)
    hw = probed_hardware(hw, plan.world_size, m["probe"], reference_s)
    predicted = predict_step_time(cfg, plan, hw)
    s = stats([t / predicted for t in m["times"]])
    return {"measured_s": m["median"], "predicted_s": predicted, "ratio": m["median"] / predicted,
            "ratio_min": s["min"], "ratio_max": s["max"], "times": m["times"],
            "hw": hw, "load": (load + os.getloadavg()[0]) / 2}


def validate(cfg: ModelConfig = TINY, layouts=None, steps: int = 6, quick_calibration: bool = True,
             hw: Hardware | None = None) -> tuple[Hardware, dict, list[tuple[str, dict]]]:
    """(calibrated + refitted hardware, the fit run, [(layout name, comparison)]). The fit run and
    every layout run the host probe around their steps, in their own processes. The fit is made
    load-free by pairing bests: its fastest step is fitted at slowdown 1, and the probe's fastest
    unit is the reference every slowdown and CPU factor is measured against; each layout's
    prediction then uses what its own probe saw, for its median step."""
    hw = hw or calibrate_machine(quick=quick_calibration)
    load = os.getloadavg()[0]
    fit_run = measure_train(cfg, FIT_PLAN, steps=steps, probe=PROBE_UNITS)
    reference = fit_run["probe"]["best"]
    hw = fit_layer_overhead(cfg, FIT_PLAN, hw, fit_run["min"])  # best step, as the best unit
    fit_run = {**fit_run, "slowdown": fit_run["probe"]["mean"] / reference,
               "load": (load + os.getloadavg()[0]) / 2}
    names = layouts or list(LAYOUTS)
    return hw, fit_run, [(n, compare(cfg, LAYOUTS[n], hw, steps, reference)) for n in names]


def probe_note(hw: Hardware) -> str:
    """What the host probe measured, as the cost model reads it."""
    text = f"compute CPU x{hw.host_cpu_factor or 1:.2f}"
    if hw.host_step_cpu_s:
        text += (f", all-reduce ring step {hw.host_step_cpu_s * 1e6:.0f} us CPU + "
                 f"{hw.host_step_wait_s * 1e6:.0f} us wait, message end {hw.host_msg_cpu_s * 1e6:.0f}"
                 f" us CPU + {hw.host_msg_wait_s * 1e6:.0f} us wait")
    return text


def run(quick: bool = True) -> list[dict]:
    """Rows: ours_s = measured step, theirs_s = predicted step, ratio = measured / predicted."""
    layouts = list(LAYOUTS) if not quick else [*QUICK_LAYOUTS, "tp2 pp2 dp2 1f1b m2"]
    hw, fit_run, results = validate(layouts=layouts, steps=12 if quick else 20,
                                    quick_calibration=quick)
    FITTED[quick] = hw
    rows = [{"name": "cost model: single process (fit run)", "ours_s": fit_run["median"],
             "theirs_s": fit_run["median"], "ratio": 1.0, "ratio_min": None, "ratio_max": None,
             "goal": None, "note": f"fits layer_overhead_s={hw.layer_overhead_s * 1e3:.2f} ms; "
                                   f"peak {hw.peak_flops / 1e9:.0f} GFLOP/s, half width "
                                   f"{hw.eff_half_width:.0f}, all-reduce "
                                   f"{hw.nvlink_bw / 1e9:.2f} GB/s + {hw.latency_s * 1e6:.0f} us; "
                                   f"host slowdown (1 process) {fit_run['slowdown']:.2f}, "
                                   f"load {fit_run['load']:.1f}"}]
    for name, c in results:
        inside = 0.7 <= c["ratio"] <= 1.3
        rows.append({"name": f"cost model: {name} measured/predicted", "ours_s": c["measured_s"],
                     "theirs_s": c["predicted_s"], "ratio": c["ratio"], "ratio_min": c["ratio_min"],
                     "ratio_max": c["ratio_max"], "goal": "0.7-1.3",
                     "note": ("within 30%" if inside else "OUTSIDE 30%")
                     + f"; {LAYOUTS[name].world_size} processes on {c['hw'].gpus_per_node} "
                       f"cores: {probe_note(c['hw'])}, load {c['load']:.1f}"})
    return rows


if __name__ == "__main__":
    for r in run(quick="--quick" in sys.argv):
        print(r)
