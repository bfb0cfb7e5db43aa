"""One-GPU check of a ~1B Llama with `--compile`: tokens/s, MFU, peak memory vs the estimator, and
the ratio to a plain compiled PyTorch loop (the Llama section of `benchmarks/gpu_check.sh`).

    python -m benchmarks.gpu_llama --device cuda --results benchmarks/RESULTS.md
    python -m benchmarks.gpu_llama --device cpu --tiny      # the same logic on a CPU, tiny shape

The model is the `llama-3.2-1b` preset (1.24B parameters: 16 layers, d_model 2048, 32 query and
8 key/value heads, SwiGLU width 8192, 128256-token vocabulary, tied head: Meta's published shape),
4 x 2048 tokens per step, bf16 with fp32 master weights, fused sdpa attention, each block compiled
by inductor (mini3d.run.compile).

1. `mini3d train --device D --dtype bf16 --attention sdpa --compile` at world size 1, as a
   subprocess, with --log-jsonl; the first `--warmup` steps (the compilation) are left out of the
   timed ones and reported apart as the compile warm-up.
2. MFU: `mini3d.run.report.model_flops_utilisation` (the trainer's own) against the bf16 peak of the
   cost package's preset matching the GPU (`gpu_check.device_peak`), or `--peak-tflops`.
3. Peak memory: the run's `peak_mem_bytes` (CUDA's allocator peak; process RSS on a CPU) next to
   `mini3d.cost.memory.estimate_memory(cfg, plan).total`.
4. The plain loop (`benchmarks/plain_loop.py`, same GPT, same batches, AdamW, pure bf16: the
   strictest baseline), its blocks compiled the same way (one torch.compile per block, as
   torchtitan does; inductor's cache serves the graphs mini3d's run just compiled, which keeps
   the whole of gpu_check.sh under five minutes); ratio = mini3d's median step / the loop's.
`--tiny`: a 4-layer llama-family model, 4 x 64 tokens, for running this logic without a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from mini3d.cli import build_parser
from mini3d.run.flags import model_from_args
from mini3d.config import Plan
from mini3d.cost.memory import estimate_memory
from mini3d.run.report import model_flops_utilisation

from .gpu_check import _ratios, device_peak, publish, run_mini3d
from .plain_loop import plain_step_times

MODEL_FLAGS = {False: ["--model", "llama-3.2-1b"],
               True: ["--model", "tiny", "--family", "llama", "--kv-heads", "2"]}


def check(tiny: bool, seq_len: int, global_batch: int, steps: int, warmup: int, device: str,
          peak_tflops: float | None = None, timeout: float = 150) -> dict:
    """Run mini3d (compiled) and the compiled plain loop; every number of the report. A failed
    mini3d run is recorded under "error" and the plain loop still runs."""
    flags = MODEL_FLAGS[tiny]
    cfg = model_from_args(build_parser().parse_args(["train", *flags]))  # the CLI's own model
    plan = Plan(global_batch=global_batch, seq_len=seq_len, dtype="bf16", attention="sdpa",
                compile="inductor")
    name, peak, peak_src = device_peak(device, peak_tflops)
    r = {"device": name, "model": cfg.name, "n_params": cfg.n_params(), "seq_len": seq_len,
         "global_batch": global_batch, "peak_flops": peak, "peak_source": peak_src,
         "estimated_mem_bytes": estimate_memory(cfg, plan).total, "error": None}
    ours = []
    try:
        records = run_mini3d(flags[1], seq_len, global_batch, steps, device, "bf16", timeout,
                             "sdpa", extra=[*flags[2:], "--compile"])
        times = [rec["step_time_s"] for rec in records]
        ours, step = times[warmup:], statistics.median(times[warmup:])
        r.update(timed_steps=len(ours), step_s=step, tokens_per_s=global_batch * seq_len / step,
                 warmup_s=sum(times[:warmup]) - warmup * step,
                 mfu=model_flops_utilisation(cfg, plan, step, peak),
                 peak_mem_bytes=max(rec["peak_mem_bytes"] for rec in records),
                 loss_first_last=(records[0]["loss"], records[-1]["loss"]))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        r["error"] = str(e)
    if device == "cpu":  # match the launched rank's single thread (mini3d.launch.launcher threads=1)
        import torch

        torch.set_num_threads(1)
    base = plain_step_times(cfg, global_batch, seq_len, steps, device, "bf16", attention="sdpa",
                            compile_blocks=True)
    theirs = base["times"][warmup:]
    r.update(plain_step_s=statistics.median(theirs),
             plain_warmup_s=sum(base["times"][:warmup]) - warmup * statistics.median(theirs),
             plain_loss_first_last=(base["losses"][0], base["losses"][-1]))
    if ours:
        q = _ratios(ours, theirs)
        r.update(ratio=q["median"], ratio_min=q["min"], ratio_max=q["max"])
    return r


def report(r: dict) -> str:
    gib = 2**30
    head = (f"Llama check on {r['device']}: {r['model']} ({r['n_params'] / 1e9:.2f}B params), "
            f"{r['global_batch']} x {r['seq_len']} tokens/step, bf16, sdpa, --compile (inductor)")
    if r["error"]:
        lines = [head, f"- mini3d train FAILED: {r['error'].strip().splitlines()[0]}", "", "```",
                 r["error"].strip()[-1500:], "```"]
    else:
        mfu = f"{100 * r['mfu']:.1f}% (peak {r['peak_flops'] / 1e12:.3g} TFLOP/s, " \
              f"{r['peak_source']})" if r["mfu"] is not None else \
              "n/a (no peak FLOP/s known for this device; pass --peak-tflops)"
        lines = [f"{head}, {r['timed_steps']} timed steps",
                 f"- mini3d train (world size 1): {r['step_s'] * 1e3:.1f} ms/step, "
                 f"{r['tokens_per_s']:,.0f} tokens/s; compile warm-up {r['warmup_s']:.1f} s "
                 f"(not in the timed steps)",
                 f"- MFU: {mfu}",
                 f"- peak memory: measured {r['peak_mem_bytes'] / gib:.2f} GiB, estimator "
                 f"{r['estimated_mem_bytes'] / gib:.2f} GiB "
                 f"(ratio {r['peak_mem_bytes'] / r['estimated_mem_bytes']:.2f})"]
    line = (f"- plain PyTorch loop, blocks compiled (bf16 parameters and AdamW state): "
            f"{r['plain_step_s'] * 1e3:.1f} ms/step, warm-up {r['plain_warmup_s']:.1f} s")
    if "ratio" in r:
        line += (f"; mini3d / this loop = {r['ratio']:.3f} (min {r['ratio_min']:.3f}, "
                 f"max {r['ratio_max']:.3f})")
    losses = [f"{label} {r[key][0]:.3f} -> {r[key][1]:.3f}" for label, key in
              (("mini3d", "loss_first_last"), ("plain", "plain_loss_first_last")) if key in r]
    return "\n".join(lines + [line, "- loss (first -> last step): " + ", ".join(losses)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_llama",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny llama, 4 x 64 tokens, 4 steps")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=150, help="seconds for the mini3d run")
    ap.add_argument("--peak-tflops", type=float, help="peak FLOP/s when no preset matches the device")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    ap.add_argument("--results", help="write the report into this RESULTS.md's gpu-llama section")
    args = ap.parse_args(argv)
    if args.tiny:
        args.seq_len, args.global_batch, args.steps, args.warmup = 64, 4, 4, 1
    if args.steps <= args.warmup:
        print(f"gpu_llama: steps={args.steps} must exceed warmup={args.warmup}", file=sys.stderr)
        return 2
    r = check(args.tiny, args.seq_len, args.global_batch, args.steps, args.warmup, args.device,
              args.peak_tflops, args.timeout)
    return publish(r, report(r), args.json, args.results, "gpu-llama",
                   "GPU path: Llama ~1B, compiled")


if __name__ == "__main__":
    raise SystemExit(main())
