"""One-GPU check of mini3d: tokens/s, MFU, peak memory vs the estimator, and the ratio to a plain loop.

    python -m benchmarks.gpu_check --device cuda                 # gpt2-small, seq 1024, bf16
    python -m benchmarks.gpu_check --device cpu --tiny --peak-tflops 0.1   # the logic, on a laptop

1. `mini3d train --device D --dtype bf16` at world size 1 (NCCL on CUDA, gloo on CPU), run as a
   subprocess exactly as a user would, with --log-jsonl; the first `--warmup` steps are dropped.
2. MFU = model FLOPs per step (`mini3d.cost.model.model_flops`, Megatron's 6N + attention count)
   / median step time / peak FLOP/s; the peak is the bf16 tensor-core peak of the preset whose name
   matches `torch.cuda.get_device_name()` (H200 / H100 / A100, 40 or 80 GB by the device memory),
   or `--peak-tflops`. Without either (a CPU), MFU is left out.
3. Peak memory: the run's `peak_mem_bytes` (CUDA's allocator peak; process RSS on CPU) next to
   `mini3d.diagnose.estimator.estimate_memory(cfg, plan).total`.
4. The plain loop (`benchmarks/plain_loop.py`: same GPT, same batches, AdamW, bf16 parameters, no
   mini3d wrappers) in this process; ratio = mini3d median step / plain median step.
`--results FILE` writes the report into FILE's "gpu" section (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from mini3d.config import Plan, model_from_preset
from mini3d.cost.hardware import PRESETS as GPUS
from mini3d.cost.model import model_flops
from mini3d.diagnose.estimator import estimate_memory

from .common import machine_description, replace_section
from .plain_loop import plain_step_times

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_for(device_name: str, memory_bytes: float | None = None) -> tuple[str, float] | None:
    """(preset name, bf16 peak FLOP/s) for a CUDA device name, or None when no preset matches."""
    name = device_name.upper()
    for key, preset in (("H200", "H200-141GB"), ("H100", "H100-80GB")):
        if key in name:
            return preset, GPUS[preset].peak_flops
    if "A100" in name:
        preset = "A100-40GB" if memory_bytes and memory_bytes < 50 * 2**30 else "A100-80GB"
        return preset, GPUS[preset].peak_flops
    return None


def run_mini3d(model: str, seq_len: int, global_batch: int, steps: int, device: str,
               dtype: str, timeout: float) -> list[dict]:
    """`mini3d train` at world size 1 in a subprocess; returns its --log-jsonl records."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, "-m", "mini3d", "train", "--model", model, "--seq-len", str(seq_len),
               "--global-batch", str(global_batch), "--steps", str(steps), "--device", device,
               "--dtype", dtype, "--no-progress", "--log-jsonl", log]
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-2000:]}")
        with open(log) as f:
            return [json.loads(line) for line in f]


def device_peak(device: str, peak_tflops: float | None) -> tuple[str, float | None, str]:
    """(device description, peak FLOP/s or None, where the peak came from)."""
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
        total = torch.cuda.get_device_properties(0).total_memory
        if peak_tflops:
            return name, peak_tflops * 1e12, "--peak-tflops"
        match = peak_for(name, total)
        return name, (match[1] if match else None), (match[0] + " preset" if match else "no preset")
    desc = machine_description()["cpu"]
    return desc, (peak_tflops * 1e12 if peak_tflops else None), "--peak-tflops" if peak_tflops else "none"


def check(model: str, seq_len: int, global_batch: int, steps: int, warmup: int, device: str,
          dtype: str = "bf16", peak_tflops: float | None = None, timeout: float = 240) -> dict:
    """Run both loops and return every number of the report."""
    cfg = model_from_preset(model)
    plan = Plan(global_batch=global_batch, seq_len=seq_len, dtype=dtype)
    records = run_mini3d(model, seq_len, global_batch, steps, device, dtype, timeout)
    ours = [r["step_time_s"] for r in records[warmup:]]
    if device == "cpu":  # match the launched rank's single thread (mini3d.launch threads=1)
        import torch

        torch.set_num_threads(1)
    plain = plain_step_times(cfg, global_batch, seq_len, steps, device, dtype)
    theirs = plain["times"][warmup:]
    name, peak, peak_src = device_peak(device, peak_tflops)
    step = statistics.median(ours)
    flops = model_flops(cfg, plan)
    return {"device": name, "model": model, "n_params": cfg.n_params(), "seq_len": seq_len,
            "global_batch": global_batch, "dtype": dtype, "timed_steps": len(ours),
            "step_s": step, "tokens_per_s": global_batch * seq_len / step,
            "mfu": flops / step / peak if peak else None, "peak_flops": peak, "peak_source": peak_src,
            "model_flops_per_step": flops,
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records),
            "estimated_mem_bytes": estimate_memory(cfg, plan).total,
            "plain_step_s": statistics.median(theirs),
            "ratio_vs_plain": step / statistics.median(theirs),
            "ratio_min": min(a / b for a, b in zip(ours, theirs)),
            "ratio_max": max(a / b for a, b in zip(ours, theirs)),
            "loss_first_last": (records[0]["loss"], records[-1]["loss"]),
            "plain_loss_first_last": (plain["losses"][0], plain["losses"][-1])}


def report(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}% (peak {r['peak_flops'] / 1e12:.3g} TFLOP/s, {r['peak_source']})" \
        if r["mfu"] is not None else "n/a (no peak FLOP/s known for this device; pass --peak-tflops)"
    gib = 2**30
    return "\n".join([
        f"GPU check on {r['device']}: {r['model']} ({r['n_params'] / 1e6:.0f}M params), "
        f"{r['global_batch']} x {r['seq_len']} tokens/step, {r['dtype']}, {r['timed_steps']} timed steps",
        f"- mini3d train (world size 1): {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s",
        f"- MFU: {mfu}",
        f"- peak memory: measured {r['peak_mem_bytes'] / gib:.2f} GiB, estimator "
        f"{r['estimated_mem_bytes'] / gib:.2f} GiB (ratio {r['peak_mem_bytes'] / r['estimated_mem_bytes']:.2f})",
        f"- plain PyTorch loop: {r['plain_step_s'] * 1e3:.1f} ms/step; mini3d / plain = "
        f"{r['ratio_vs_plain']:.3f} (min {r['ratio_min']:.3f}, max {r['ratio_max']:.3f})",
        f"- loss mini3d {r['loss_first_last'][0]:.3f} -> {r['loss_first_last'][1]:.3f}, plain "
        f"{r['plain_loss_first_last'][0]:.3f} -> {r['plain_loss_first_last'][1]:.3f}"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny model, 4 x 64 tokens, 4 steps (tests)")
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, help="peak FLOP/s when no preset matches the device")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    ap.add_argument("--results", help="write the report into this RESULTS.md's gpu section")
    args = ap.parse_args(argv)
    if args.tiny:
        args.model, args.seq_len, args.global_batch, args.steps, args.warmup = "tiny", 64, 4, 4, 1
    if args.steps <= args.warmup:
        print(f"gpu_check: steps={args.steps} must exceed warmup={args.warmup}", file=sys.stderr)
        return 2
    r = check(args.model, args.seq_len, args.global_batch, args.steps, args.warmup, args.device,
              peak_tflops=args.peak_tflops)
    text = report(r)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    if args.results:
        m = machine_description()
        replace_section(args.results, "gpu", f"## GPU path\n\n{text}\n\n(torch {m['torch']}, {m['date']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
