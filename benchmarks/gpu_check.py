"""One-GPU check of mini3d: tokens/s, MFU, peak memory vs the estimator, and the ratio to a plain loop.

    python -m benchmarks.gpu_check --device cuda                 # gpt2-small, seq 1024, bf16
    python -m benchmarks.gpu_check --device cpu --tiny --peak-tflops 0.1   # the logic, on a laptop

1. `mini3d train --device D --dtype bf16` at world size 1 (NCCL on CUDA, gloo on CPU), run as a
   subprocess exactly as a user would, with --log-jsonl; the first `--warmup` steps are dropped.
2. MFU = model FLOPs per step (`mini3d.cost.flops.model_flops`, Megatron's 6N + attention count)
   / median step time / peak FLOP/s; the peak is the bf16 tensor-core peak of the preset whose name
   matches `torch.cuda.get_device_name()` (H200 / H100 / A100, 40 or 80 GB by the device memory),
   or `--peak-tflops`. Without either (a CPU), MFU is left out.
3. Peak memory: the run's `peak_mem_bytes` (CUDA's allocator peak; process RSS on CPU) next to
   `mini3d.cost.memory.estimate_memory(cfg, plan).total`.
4. Two plain loops (`benchmarks/plain_loop.py`: same GPT, same batches, AdamW, no mini3d wrappers)
   in this process: pure bf16 (the strictest: no fp32 masters) and fp32 parameters under bf16
   autocast (the usual recipe); ratio = mini3d median step / the loop's median step.
5. `--profile-steps N`: N more mini3d steps at world size 1 under torch.profiler, top operators by
   self device time (CUDA) or self CPU time: where the time goes if the ratio is off.
A failed mini3d run is reported with its stderr, the plain loops still run, and the exit code is 1.
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
from mini3d.cost.flops import model_flops
from mini3d.cost.memory import estimate_memory

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
               dtype: str, timeout: float, attention: str = "explicit", extra=()) -> list[dict]:
    """`mini3d train` at world size 1 in a subprocess (`extra`: more flags, e.g. --compile);
    returns its --log-jsonl records."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, "-m", "mini3d", "train", "--model", model, "--seq-len", str(seq_len),
               "--global-batch", str(global_batch), "--steps", str(steps), "--device", device,
               "--dtype", dtype, "--attention", attention, "--no-progress", "--log-jsonl", log,
               *extra]
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


def profile_mini3d(cfg, plan: Plan, steps: int, device: str, top: int = 12) -> str:
    """torch.profiler table of `steps` mini3d steps at world size 1 (by self device time on CUDA)."""
    from mini3d.launch.launcher import launch
    from mini3d.run.train import make_spec

    from .profile_3d import _profiled_worker

    spec = make_spec(cfg, plan, steps=steps)
    return launch(_profiled_worker, 1, spec, top, device == "cuda", device=device, timeout=240)[0]["ops"]


def _ratios(ours: list[float], theirs: list[float]) -> dict:
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"median": statistics.median(ours) / statistics.median(theirs),
            "min": min(ratios), "max": max(ratios)}


def check(model: str, seq_len: int, global_batch: int, steps: int, warmup: int, device: str,
          dtype: str = "bf16", peak_tflops: float | None = None, timeout: float = 240,
          profile_steps: int = 0, attention: str = "explicit") -> dict:
    """Run mini3d and the plain loops and return every number of the report. A failed mini3d run
    is recorded under "error" and the plain loops still run, so one GPU session learns both."""
    cfg = model_from_preset(model)
    plan = Plan(global_batch=global_batch, seq_len=seq_len, dtype=dtype, attention=attention)
    name, peak, peak_src = device_peak(device, peak_tflops)
    flops = model_flops(cfg, plan)
    r = {"device": name, "model": model, "n_params": cfg.n_params(), "seq_len": seq_len,
         "global_batch": global_batch, "dtype": dtype, "attention": attention, "peak_flops": peak, "peak_source": peak_src,
         "model_flops_per_step": flops, "estimated_mem_bytes": estimate_memory(cfg, plan).total,
         "error": None, "profile": None}
    try:
        records = run_mini3d(model, seq_len, global_batch, steps, device, dtype, timeout, attention)
        ours = [rec["step_time_s"] for rec in records[warmup:]]
        step = statistics.median(ours)
        r.update(timed_steps=len(ours), step_s=step, tokens_per_s=global_batch * seq_len / step,
                 mfu=flops / step / peak if peak else None,
                 peak_mem_bytes=max(rec["peak_mem_bytes"] for rec in records),
                 loss_first_last=(records[0]["loss"], records[-1]["loss"]))
        if profile_steps:
            r["profile"] = profile_mini3d(cfg, plan, profile_steps, device)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        ours, r["error"] = [], str(e)
    if device == "cpu":  # match the launched rank's single thread (mini3d.launch.launcher threads=1)
        import torch

        torch.set_num_threads(1)
    # the strictest baseline first (pure bf16, no fp32 masters), then the usual autocast loop
    for key, recipe in (("plain", dtype), ("amp", "amp")) if dtype == "bf16" else (("plain", dtype),):
        base = plain_step_times(cfg, global_batch, seq_len, steps, device, recipe, attention=attention)
        theirs = base["times"][warmup:]
        r[f"{key}_step_s"] = statistics.median(theirs)
        r[f"{key}_loss_first_last"] = (base["losses"][0], base["losses"][-1])
        if ours:
            q = _ratios(ours, theirs)
            r[f"ratio_vs_{key}"], r[f"{key}_ratio_min"], r[f"{key}_ratio_max"] = q["median"], q["min"], q["max"]
    return r


def report(r: dict) -> str:
    gib = 2**30
    head = (f"GPU check on {r['device']}: {r['model']} ({r['n_params'] / 1e6:.0f}M params), "
            f"{r['global_batch']} x {r['seq_len']} tokens/step, {r['dtype']}, {r['attention']} attention")
    lines = []
    if r["error"]:
        lines += [head, f"- mini3d train FAILED: {r['error'].strip().splitlines()[0]}", "", "```",
                  r["error"].strip()[-1500:], "```"]
    else:
        mfu = f"{100 * r['mfu']:.1f}% (peak {r['peak_flops'] / 1e12:.3g} TFLOP/s, {r['peak_source']})" \
            if r["mfu"] is not None else "n/a (no peak FLOP/s known for this device; pass --peak-tflops)"
        lines += [
            f"{head}, {r['timed_steps']} timed steps",
            f"- mini3d train (world size 1): {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s",
            f"- MFU: {mfu}",
            f"- peak memory: measured {r['peak_mem_bytes'] / gib:.2f} GiB, estimator "
            f"{r['estimated_mem_bytes'] / gib:.2f} GiB (ratio {r['peak_mem_bytes'] / r['estimated_mem_bytes']:.2f})"]
    names = {"plain": f"plain PyTorch loop ({r['dtype']} parameters and AdamW state)",
             "amp": "plain PyTorch loop (fp32 parameters, bf16 autocast)"}
    for key in ("plain", "amp"):
        if f"{key}_step_s" not in r:
            continue
        line = f"- {names[key]}: {r[f'{key}_step_s'] * 1e3:.1f} ms/step"
        if f"ratio_vs_{key}" in r:
            line += (f"; mini3d / this loop = {r[f'ratio_vs_{key}']:.3f} "
                     f"(min {r[f'{key}_ratio_min']:.3f}, max {r[f'{key}_ratio_max']:.3f})")
        lines.append(line)
    losses = [f"{label} {r[key][0]:.3f} -> {r[key][1]:.3f}" for label, key in
              (("mini3d", "loss_first_last"), ("plain", "plain_loss_first_last"),
               ("amp", "amp_loss_first_last")) if key in r]
    lines.append("- loss (first -> last step): " + ", ".join(losses))
    if r["profile"]:
        lines += ["", "mini3d's operators, one rank (torch.profiler):", "", "```", r["profile"].rstrip(), "```"]
    return "\n".join(lines)


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
    ap.add_argument("--attention", default="explicit", choices=["explicit", "sdpa"],
                    help="mini3d's and the plain loops' attention core (sdpa: fused, as real runs use)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="also profile this many mini3d steps and print the top operators")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    ap.add_argument("--results", help="write the report into this RESULTS.md's gpu section")
    args = ap.parse_args(argv)
    if args.tiny:
        args.model, args.seq_len, args.global_batch, args.steps, args.warmup = "tiny", 64, 4, 4, 1
    if args.steps <= args.warmup:
        print(f"gpu_check: steps={args.steps} must exceed warmup={args.warmup}", file=sys.stderr)
        return 2
    r = check(args.model, args.seq_len, args.global_batch, args.steps, args.warmup, args.device,
              peak_tflops=args.peak_tflops, profile_steps=args.profile_steps, attention=args.attention)
    return publish(r, report(r), args.json, args.results, "gpu", "GPU path")


def publish(r: dict, text: str, json_path, results_path, key: str, title: str) -> int:
    """Print a check's report, write its JSON and its RESULTS.md section (when asked); exit 1
    when the check recorded an error."""
    print(text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(r, f, indent=2)
    if results_path:
        m = machine_description()
        replace_section(results_path, key, f"## {title}\n\n{text}\n\n(torch {m['torch']}, {m['date']})")
    return 1 if r["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
