"""`python -m benchmarks [--quick] [--only NAME,...]`: every comparison in one table, and RESULTS.md.

Runs, on local CPU processes with gloo, each benchmark module's `run(quick)`:

    one_process   mini3d on one process vs a plain PyTorch loop (tiny, float32)
    dp_bench      mini3d DataParallel vs DDP (dp=2), ZeRO-3 vs FSDP2
    tp_bench      TP MLP block vs torch.distributed.tensor.parallel
    pp_torch      pipeline 1F1B / GPipe runtime vs torch.distributed.pipelining
    pp_bubble     measured pipeline bubble vs the simulator's
    train_runs    tokens/s of the tiny 3D run (tp2 pp2 dp2)
    cost_local    cost model predicted vs measured step time (calibrated first, in this run)
    overlap_bench measured hidden fraction of dp sync and pp p2p vs the cost model's assumption
    compile_bench --compile (inductor) vs eager, one process and tp2, and the compile warm-up
    sample_bench  `mini3d sample` tokens/s with the KV cache vs without (tiny, one process)
    moe_bench     a one-process MoE step vs a plain PyTorch loop over experts (same weights)

prints one table and writes it, with the machine description, to benchmarks/RESULTS.md (the
sections other scripts own there, e.g. profile_3d's, are kept). A module that fails becomes a row
saying so; the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback

from .common import machine_description, markdown_table, replace_section

MODULES = ("one_process", "dp_bench", "tp_bench", "pp_torch", "pp_bubble", "train_runs",
           "cost_local", "overlap_bench", "compile_bench", "sample_bench", "moe_bench")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")

GPU_NOTE = """## GPU path

Pending a GPU: no CUDA device was available where this file was written. On a machine with one
CUDA GPU run `bash benchmarks/gpu_check.sh` (mini3d train --device cuda --dtype bf16 at world size 1
on gpt2-small, tokens/s, MFU against the matching H100/H200/A100 preset, peak CUDA memory next to
the estimator's prediction, the step-time ratio to two plain PyTorch loops (pure bf16; fp32 under
bf16 autocast) and a torch.profiler table, then llama-3.2-1b in bf16 with sdpa and --compile:
tokens/s, MFU, compile warm-up, peak memory vs the estimate, ratio to a plain loop with compiled
blocks); its output goes here. `GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh` runs the same logic
on a CPU with tiny shapes.
"""


OVERLAP_NOTE = ("Overlap rows (`mini3d.diagnose.overlap`): of the seconds each dp gradient-sync op "
                "(all-reduce / reduce-scatter / all-gather on the dp axis) or pp send / receive was in "
                "flight, from its issue to its completion as the event log records it, the share that "
                "fell inside the rank's F / B / W actions of its timeline (tp collectives count as "
                "compute), summed over the ranks of the last step; min/median/max over the ranks. An "
                "async op's completion is logged when the host learns of it, so the hidden share is an "
                "upper bound; a blocking receive is all exposed. The note gives the cost model's "
                "assumption for the same plan (dp: 1 - dp_exposed / dp_total; p2p: none hidden).")


def run_all(quick: bool, only=None) -> tuple[list[dict], dict]:
    rows, seconds = [], {}
    for name in only or MODULES:
        t0 = time.perf_counter()
        print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
        try:
            rows += importlib.import_module(f"benchmarks.{name}").run(quick)
        except Exception as e:  # one broken module must not hide the others' results
            rows.append({"name": f"{name}: FAILED", "ours_s": None, "theirs_s": None, "ratio": None,
                         "note": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"})
            traceback.print_exc()
        seconds[name] = time.perf_counter() - t0
    return rows, seconds


def report(rows: list[dict], seconds: dict, quick: bool) -> str:
    m = machine_description()
    total = sum(seconds.values())
    lines = ["## Benchmarks (`python -m benchmarks" + (" --quick" if quick else "") + "`)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}, "
             f"{m['os']}; run {m['date']}, load average at the end {m['load_avg_1m']:.1f} "
             f"(other jobs share these cores: read medians, expect wide spreads).", "",
             "Ratios are ours / theirs per repeat (< 1: mini3d faster); for the bubble rows measured / "
             "simulated makespan; for the cost-model rows measured / predicted step time.", "",
             OVERLAP_NOTE, "",
             markdown_table(rows), "",
             "Wall time per module: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
             + f"; total {total:.0f} s."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (under five minutes)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(MODULES)}")
    ap.add_argument("--no-write", action="store_true", help="print only, leave RESULTS.md alone")
    args = ap.parse_args(argv)
    only = args.only.split(",") if args.only else None
    bad = [n for n in only or () if n not in MODULES]
    if bad:
        print(f"python -m benchmarks: unknown module(s) {bad} (choose from {list(MODULES)})",
              file=sys.stderr)
        return 2
    rows, seconds = run_all(args.quick, only)
    text = report(rows, seconds, args.quick)
    print(text)
    if not args.no_write:
        if not os.path.exists(RESULTS):
            with open(RESULTS, "w") as f:
                f.write("# mini3d benchmark results\n\nWritten by the scripts in benchmarks/; "
                        "do not edit by hand.\n")
        replace_section(RESULTS, "table", text)
        if "<!-- begin gpu -->" not in open(RESULTS).read():  # never over a recorded GPU report
            replace_section(RESULTS, "gpu", GPU_NOTE)
        print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
