"""`python -m benchmarks.gpu_extras --device cuda|cpu [--tiny]`: issue #34's checks on one GPU
(world size 1; benchmarks/gpu_check.sh runs it as its fourth section).

1. Host syncs per optimizer step of a bf16 `train_worker` run with gradient clipping and the stop
   agreement: `mini3d.run.syncs.count_syncs` (the program's scalar reads, as tests/test_host_syncs.py
   counts them on CPU) and, on CUDA, torch's own sync debug mode (every call that made the host
   wait, pageable copies included). The goal: at most one a step after the first.
2. The fused ring-attention block (`mini3d.cp.blocks`: `kernel_for` gives "cuda-flash" for bf16 on
   CUDA, "cpu-flash" on CPU): queries against two key blocks, merged, forward and backward from the
   final out and lse, against the explicit math on the same inputs; the largest error relative to
   the explicit result's largest value, and the milliseconds of each (median of 5).
3. The measured timeline on the device's clock (`mini3d.timeline_clock`: on CUDA timing events
   resolved at the step's read-back, the GPU's times; perf_counter on CPU): the last step's
   forwards and backwards of a world-size-1 run (`collect=["timeline"]`), their seconds against
   the step's (host, start to read-back). Launch times would make a GPU step's actions a sliver of
   it; the GPU's fill most of it and never run past it. The overlap of the dp gradient sync
   behind the backward needs two GPUs (dp >= 2): not measured here; its analysis reads the same
   clock (`mini3d.diagnose.overlap`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from mini3d.config import ModelConfig, Plan


def syncs_per_step(device: str, tiny: bool) -> dict:
    from mini3d.launch.launcher import launch
    from mini3d.run.syncs import count_syncs
    from mini3d.run.train import make_spec

    cfg = (ModelConfig(2, 32, 4, 256, 16, name="extras-tiny") if tiny else
           ModelConfig(12, 768, 12, 256, 256, name="extras-gpt2-shape"))  # byte tokenizer: 256
    plan = Plan(global_batch=4, seq_len=cfg.max_seq_len, micro_batches=2, dtype="bf16")
    spec = make_spec(cfg, plan, steps=5, grad_clip=1.0).replace(stop_on_signal=True)
    steps = launch(count_syncs, 1, [spec], device, device=device, timeout=600)[0][0]
    steady = steps[1:-1]  # the first makes AdamW's state; the last runs on to the loop's end
    return {"program_syncs": [s["syncs"] for s in steady],
            "cuda_syncs": [s["cuda_syncs"] for s in steady] if device == "cuda" else None,
            "where": sorted({w for s in steady for w in s["where"]}),
            "ok": all(s["syncs"] <= 1 and (device != "cuda" or s["cuda_syncs"] <= 1) for s in steady)}


def timeline_check(device: str, tiny: bool) -> dict:
    """Section 3 (module docstring): {"clock", "actions", "compute_s", "span_s", "step_s",
    "fraction" (compute / step), "ok"}."""
    from mini3d.launch.launcher import launch
    from mini3d.run.train import make_spec, train_worker
    from mini3d.timeline_clock import clock_for

    cfg = (ModelConfig(2, 32, 4, 256, 16, name="extras-tiny") if tiny else
           ModelConfig(12, 768, 12, 256, 256, name="extras-gpt2-shape"))
    plan = Plan(global_batch=4, seq_len=cfg.max_seq_len, micro_batches=2, dtype="bf16")
    r = launch(train_worker, 1, make_spec(cfg, plan, steps=3, collect=("timeline",)), device=device,
               timeout=600)[0]
    tl, step = r["timeline"], r["records"][-1]["step_time_s"]
    span = max(e for _, e, _ in tl) - min(s for s, _, _ in tl) if tl else 0.0
    compute = sum(e - s for s, e, _ in tl)
    ok = (len(tl) == 2 * plan.micro_batches and all(isinstance(s, float) and e >= s for s, e, _ in tl)
          and 0 < span <= step + 1e-3)  # 1 ms: the anchor's host/GPU offset (timeline_clock)
    return {"clock": "cuda events" if clock_for(device).gpu else "perf_counter", "actions": len(tl),
            "compute_s": compute, "span_s": span, "step_s": step,
            "fraction": compute / step if step else 0.0, "ok": ok}


def _sync(device: str):
    if device == "cuda":
        torch.ones(1, device=device).cpu()  # a copy back waits for everything queued before it


def ring_block(device: str, tiny: bool) -> dict:
    from mini3d.cp import blocks

    B, nh, T, hd = (1, 2, 64, 16) if tiny else (1, 16, 2048, 128)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, dout = (torch.randn(B, nh, T, hd, generator=g).to(device, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, nh, 2 * T, hd, generator=g).to(device, torch.bfloat16) for _ in range(2))
    scale = 1 / math.sqrt(hd)
    halves = [(k[..., :T, :], v[..., :T, :], False), (k[..., T:, :], v[..., T:, :], True)]

    def run(kind):
        out, lse = blocks.merge(*blocks.block_forward(q, *halves[0], kind, scale),
                                *blocks.block_forward(q, *halves[1], kind, scale))
        grads = [blocks.block_backward(dout, q, kk, vv, out, lse, c, kind, scale) for kk, vv, c in halves]
        return out, [t for gr in grads for t in gr]

    res, times = {}, {}
    for kind in ("sdpa", "explicit"):
        ms = []
        for _ in range(5):
            _sync(device)
            t0 = time.perf_counter()
            res[kind] = run(kind)
            _sync(device)
            ms.append((time.perf_counter() - t0) * 1e3)
        times[kind] = statistics.median(ms)
    (o1, g1), (o2, g2) = res["sdpa"], res["explicit"]
    err = max([float((a - b).abs().max() / b.abs().max()) for a, b in zip([o1, *g1], [o2, *g2])])
    return {"kernel": blocks.kernel_for(q, "sdpa"), "shape": [B, nh, T, hd], "rel_err": err,
            "fused_ms": times["sdpa"], "explicit_ms": times["explicit"],
            "ok": err < 3e-2}  # bf16 inputs: the kernel rounds out and dout to bf16 in its backward


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the logic on a CPU)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    report = {"syncs": syncs_per_step(a.device, a.tiny), "ring": ring_block(a.device, a.tiny),
              "timeline": timeline_check(a.device, a.tiny), "overlap": "needs dp >= 2: two GPUs"}
    s, r, t = report["syncs"], report["ring"], report["timeline"]
    print(f"gpu_extras ({a.device}): syncs per step after the first {s['program_syncs']} (program)"
          + (f", {s['cuda_syncs']} (CUDA sync debug)" if s["cuda_syncs"] is not None else "")
          + f" at {', '.join(s['where']) or '-'}: {'ok' if s['ok'] else 'MORE THAN ONE'}")
    print(f"gpu_extras ({a.device}): ring block kernel {r['kernel']} on {r['shape']}: relative error "
          f"{r['rel_err']:.1e} against the explicit math, {r['fused_ms']:.2f} ms vs "
          f"{r['explicit_ms']:.2f} ms: {'ok' if r['ok'] else 'OFF'}")
    print(f"gpu_extras ({a.device}): timeline on {t['clock']}: {t['actions']} actions, "
          f"{t['compute_s'] * 1e3:.2f} ms of compute over {t['span_s'] * 1e3:.2f} ms in a "
          f"{t['step_s'] * 1e3:.2f} ms step ({t['fraction']:.0%}): {'ok' if t['ok'] else 'OFF'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if s["ok"] and r["ok"] and t["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
