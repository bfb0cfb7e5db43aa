"""Calibration: the two published rows the efficiency constants are fitted on, and measuring this
machine (matmul throughput, memory and gloo all-reduce bandwidth) into a Hardware description.

The ONLY data the GPU constants see are two rows of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", table of end-to-end iteration times), A100-80GB,
Megatron-LM, s=2048, V=51200, sequence parallelism + selective recompute, no data parallelism:

    22B : h=6144,  64 heads, 48 layers, tp8 pp1, 8 GPUs, global batch 4, micro-batch 4  -> 1.10 s
    175B: h=12288, 96 heads, 96 layers, tp8 pp8 interleaved (3 chunks), 64 GPUs, global
          batch 64, micro-batch 1                                                       -> 13.75 s

Step time is linear in 1/efficiency for each row (T = C / eff + R, C the compute seconds at full
peak including its bubble share, R everything else), so each row yields the efficiency it needs;
the two efficiencies at the rows' matmul widths (768 and 1536) give `eff_max` and `half_width` of
`Efficiency` in closed form. Both rows are then reproduced exactly (the test allows 5%).
"""

from __future__ import annotations

import os
import time

import torch

from mini3d.comm import ring_steps
from mini3d.config import PRESETS as MODELS
from mini3d.config import Plan
from mini3d.cost.hardware import PRESETS as GPUS
from mini3d.cost.hardware import Hardware
from mini3d.cost.host_probe import host_cores
from mini3d.cost.model import Efficiency, estimate_cost


def matmul_compute_s(breakdown: dict) -> float:
    """The compute seconds that scale with 1 / efficiency: `compute` less its memory-bound parts
    (the attention scores' and the elementwise kernels' HBM traffic), what the fits solve for."""
    return breakdown["compute"] - breakdown["attention_scores"] - breakdown["elementwise"]


def calibration_rows() -> list[dict]:
    """The two published rows: model, plan, GPU count, hardware and the measured seconds."""
    common = dict(seq_len=2048, dtype="bf16", sequence_parallel=True, recompute="selective")
    return [
        {"name": "22B", "model": MODELS["gpt-22b"], "n_gpus": 8, "hw": GPUS["A100-80GB"],
         "plan": Plan(tp=8, pp=1, dp=1, global_batch=4, micro_batches=1, **common),
         "measured_s": 1.10},
        {"name": "175B", "model": MODELS["gpt-175b"], "n_gpus": 64, "hw": GPUS["A100-80GB"],
         "plan": Plan(tp=8, pp=8, dp=1, schedule="interleaved", virtual_stages=3, global_batch=64,
                      micro_batches=64, **common),
         "measured_s": 13.75},
    ]


def fit_efficiency(rows: list[dict] | None = None) -> Efficiency:
    """Solve eff_max and half_width so that the model reproduces both rows."""
    rows = rows or calibration_rows()
    points = []
    for r in rows:
        ideal = estimate_cost(r["model"], r["plan"], r["hw"], r["n_gpus"], eff=Efficiency(1.0, 0.0))
        c = matmul_compute_s(ideal.breakdown) / (1 - ideal.bubble_fraction)
        rest = ideal.step_time_s - c
        width = min(r["model"].d_model / r["plan"].tp, r["plan"].micro_batch_size * r["plan"].seq_len)
        points.append((width, c / (r["measured_s"] - rest)))
    (w1, e1), (w2, e2) = points
    ratio = e2 / e1
    half = w1 * w2 * (ratio - 1) / (w2 - ratio * w1)
    return Efficiency(eff_max=e1 * (w1 + half) / w1, half_width=half)


def reproduce_rows(eff: Efficiency | None = None) -> list[dict]:
    """Predicted vs measured seconds for each row (with `eff`, default the stored constants)."""
    out = []
    for r in calibration_rows():
        est = estimate_cost(r["model"], r["plan"], r["hw"], r["n_gpus"], eff=eff)
        out.append({"name": r["name"], "predicted_s": est.step_time_s, "measured_s": r["measured_s"],
                    "error": est.step_time_s / r["measured_s"] - 1, "mfu": est.mfu})
    return out


# ----------------------------------------------------------------------------- this machine

def _fit_line(xs, ys):
    """Least-squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_matmul(widths=(32, 64, 128, 256, 512), tokens: int = 512, repeats: int = 5) -> dict:
    """float32 matmul FLOP/s on one thread (mini3d's CPU ranks run one thread each) at each width
    w, for a (tokens, w) @ (w, 4w) product, and the fit rate(w) = peak * w / (w + half_width)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = {}
        for w in widths:
            a, b = torch.randn(tokens, w), torch.randn(w, 4 * w)
            rates[w] = 2 * tokens * w * 4 * w / _best_time(lambda: a @ b, repeats)
    finally:
        torch.set_num_threads(threads)
    # 1/rate = 1/peak + (half_width/peak) * (1/w): a straight line in 1/w
    inv_peak, slope = _fit_line([1 / w for w in widths], [1 / r for r in rates.values()])
    peak = 1 / inv_peak if inv_peak > 0 else max(rates.values())
    return {"rates": rates, "peak_flops": peak, "half_width": max(0.0, slope * peak)}


def measure_memory_bw(n_bytes: int = 64 * 2**20, repeats: int = 5) -> float:
    src = torch.empty(n_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * n_bytes / _best_time(lambda: dst.copy_(src), repeats)


def allreduce_probe(sizes: list[int], repeats: int) -> list[tuple[int, float]]:
    """Run on each of 2 launched ranks: the median seconds of a traced all-reduce per payload size,
    each issued right after ~1 ms of single-thread matmuls, as a tp all-reduce follows a layer's
    compute in a training step. That is the typical in-step cost, not the best case of back-to-back
    calls after a barrier: the gloo threads have gone idle, caches are cold, and the partner
    arrives with the skew of its own compute."""
    import statistics

    import torch.distributed as dist

    from mini3d import comm
    from mini3d.grid import Grid, build_topology

    topo = build_topology(Grid(1, 1, dist.get_world_size()), dist.get_rank())
    dev = topo.device  # explicit: a launched worker's default device may be meta (strict mode)
    a, b = torch.randn(256, 64, device=dev), torch.randn(64, 256, device=dev)
    out = []
    for n in sizes:
        x = torch.ones(max(1, n // 4), device=dev)
        comm.all_reduce(x, topo.dp)
        times = []
        for _ in range(repeats):
            for _ in range(PROBE_MATMULS):
                a @ b
            t0 = time.perf_counter()
            comm.all_reduce(x, topo.dp)
            times.append(time.perf_counter() - t0)
        out.append((x.numel() * 4, statistics.median(times)))
    return out


PROBE_MATMULS = 12  # 12 x 8.4 MFLOP: about 1 ms on one core


def measure_allreduce(sizes=(2**10, 2**14, 2**17, 2**20, 2**22), repeats: int = 9) -> dict:
    """gloo all-reduce between 2 local processes (wire bytes = 2(n-1)/n * payload = the payload for
    n = 2): the call's latency is the smaller median of the two smallest payloads (both are all
    latency), and `latency_s` that over the 2(n-1) = 2 ring steps it takes;
    bandwidth from the least-squares slope over all sizes (a plain line fit lets the large sizes' noise swing the intercept)."""
    from mini3d.launch.launcher import launch

    res = launch(allreduce_probe, 2, list(sizes), repeats, device="cpu", timeout=120)
    worst = [max(a[1], b[1]) for a, b in zip(*res)]
    latency = min(worst[:2]) / ring_steps("all_reduce", 2)  # Hardware.latency_s is one ring step
    _, per_byte = _fit_line([s for s, _ in res[0]], worst)
    bw = 1 / per_byte if per_byte > 0 else float(sizes[-1]) / worst[-1]
    return {"times": list(zip([s for s, _ in res[0]], worst)), "bandwidth": bw,
            "latency_s": max(latency, 1e-6)}


def measure_layer_overhead(peak_flops: float, half_width: float,
                           repeats: int = 5) -> tuple[float, float]:
    """(seconds per layer and micro-batch, seconds per layer and token): what one small mini3d Block
    (h=64) spends in forward + backward beyond its FLOPs at the fitted matmul rate (one thread).

    The Block is timed at two micro-batch sizes (2 x 64 and 8 x 64 tokens) and the excess over the
    FLOPs fitted as a line in the token count: the intercept is the per-op cost (Python, autograd,
    dispatch) that dominates tiny CPU runs; the slope the memory-bound work per token the matmul
    FLOPs leave out (softmax over the s x s scores, GELU, LayerNorm, the batched per-head matmuls)."""
    from mini3d.config import ModelConfig
    from mini3d.models.transformer import Block
    from mini3d.cost.model import Efficiency
    from mini3d.cost.flops import flops_per_token

    cfg = ModelConfig(1, 64, 4, 256, 64)
    rate = peak_flops * Efficiency(1.0, half_width).at(cfg.d_model)
    per_token_flops_s = 3 * flops_per_token(cfg, 64)["layer"] / rate
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        block, excess = Block(cfg), []
        for b in LAYER_PROBE_BATCHES:
            x = torch.randn(b, 64, 64, requires_grad=True)
            seconds = _best_time(lambda: block(x).sum().backward(), repeats)
            excess.append(seconds - per_token_flops_s * b * 64)
    finally:
        torch.set_num_threads(threads)
    fixed, per_token = _fit_line([b * 64 for b in LAYER_PROBE_BATCHES], excess)
    return max(0.0, fixed), max(0.0, per_token)


LAYER_PROBE_BATCHES = (2, 8)


def calibrate_machine(quick: bool = False) -> Hardware:
    """A Hardware description of this CPU machine for predicting mini3d's own gloo runs."""
    reps = 3 if quick else 7
    mm = measure_matmul(repeats=max(reps, 9))  # best of 9 even when quick: matmuls take ms, and
    # a shared machine's load only ever slows a repeat down, so more repeats find its free moments
    ar = measure_allreduce(repeats=4 * reps + 9)
    cores = host_cores()  # the affinity's cores: `taskset -c 0` makes a one-core machine
    fixed, per_token = measure_layer_overhead(mm["peak_flops"], mm["half_width"], max(reps, 7))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(name=f"cpu-{os.uname().nodename}", peak_flops=mm["peak_flops"],
                    memory_bytes=float(ram), memory_bw=measure_memory_bw(repeats=reps),
                    nvlink_bw=ar["bandwidth"], internode_bw=ar["bandwidth"], gpus_per_node=cores,
                    latency_s=ar["latency_s"], eff_max=1.0, eff_half_width=mm["half_width"],
                    shared_host=True, layer_overhead_s=fixed, token_overhead_s=per_token)
