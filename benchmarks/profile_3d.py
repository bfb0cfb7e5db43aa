"""Profile one rank of the tiny 3D run (tp2 pp2 dp2, 1F1B, m=2) and record it in RESULTS.md.

    python -m benchmarks.profile_3d [--label before|after] [--steps N] [--no-write]

Rank 0 (first pipeline stage, tp_rank 0, dp_rank 0) runs `mini3d.run.train.train_worker` under both
torch.profiler (operator self-CPU time: the math and the collectives) and cProfile (Python time per
function: where mini3d's own per-op costs show). The other 7 ranks run unprofiled. The section
"profile-LABEL" of benchmarks/RESULTS.md gets the run's tokens/s (the same 8-process measurement
as `python -m benchmarks`, unprofiled, median over steps) and the top entries of each profile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats

import torch.distributed as dist

from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec, train_worker

from .common import replace_section
from .train_runs import PLAN_3D, TINY, measure_train

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def _profiled_worker(spec: dict, top: int, device_time: bool = False):
    """train_worker on every rank; rank 0 under torch.profiler + cProfile, returns both tables.
    device_time: also record CUDA kernels and sort operators by their self device time."""
    if dist.get_rank() != 0:
        train_worker(spec)
        return None
    from torch.profiler import ProfilerActivity, profile

    prof = cProfile.Profile()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_time else [])
    with profile(activities=activities) as tprof:
        prof.enable()
        train_worker(spec)
        prof.disable()
    ops = tprof.key_averages().table(
        sort_by="self_device_time_total" if device_time else "self_cpu_time_total",
        row_limit=top, max_name_column_width=40)
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s).sort_stats("tottime")
    stats.print_stats(r"mini3d|torch/(autograd|optim|nn/modules|distributed/distributed_c10d)", top)
    py = "\n".join(line for line in s.getvalue().splitlines()
                   if line.strip() and not line.startswith(("   Ordered", "   List reduced")))
    return {"ops": ops, "python": py}


def profile_3d(steps: int = 10, top: int = 15) -> dict:
    spec = make_spec(TINY, PLAN_3D, steps=steps, seed=0)
    out = launch(_profiled_worker, PLAN_3D.world_size, spec, top, device="cpu", timeout=600)[0]
    m = measure_train(TINY, PLAN_3D, steps=steps)
    return {**out, "tokens_per_s": m["tokens_per_s"], "tokens_per_s_all": m["tokens_per_s_all"],
            "step_s": m["median"]}


def section(label: str, r: dict, steps: int) -> str:
    tps = r["tokens_per_s_all"]
    return "\n".join([
        f"## Profile of the tiny 3D run ({label})", "",
        f"tp2 pp2 dp2, 1F1B, 2 micro-batches, 8 x 64 tokens/step, {steps} steps: "
        f"**{r['tokens_per_s']:,.0f} tokens/s** (median step {r['step_s'] * 1e3:.1f} ms; "
        f"min/max {min(tps):,.0f}/{max(tps):,.0f}), unprofiled run. Profiles: rank 0, whole run.", "",
        "Top operators by self CPU time (torch.profiler):", "", "```", r["ops"].rstrip(), "```", "",
        "Top Python functions by own time (cProfile, mini3d / torch Python layers):", "", "```",
        r["python"].rstrip(), "```"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_3d")
    ap.add_argument("--label", default="after", help="section label, e.g. before / after")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    r = profile_3d(args.steps)
    text = section(args.label, r, args.steps)
    print(text)
    if not args.no_write:
        replace_section(RESULTS, f"profile-{args.label}", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
