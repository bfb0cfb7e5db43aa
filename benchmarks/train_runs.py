"""Measuring real `mini3d train` runs (the same worker the CLI spawns) on local gloo/CPU processes.

`measure_train(cfg, plan, steps, warmup)` launches `plan.world_size` processes running
`mini3d.run.train.train_worker` and returns the reporting rank's per-step times, dropping the first
`warmup` steps (first-touch allocations, gloo connection set-up, autograd graph caching).

`run(quick)` gives the tokens/s row of the tiny 3D run (tp2 pp2 dp2, 1F1B) for the combined table.
"""

from __future__ import annotations

import statistics

from mini3d.config import PRESETS, ModelConfig, Plan
from mini3d.cost.host_probe import probe_worker, summarise
from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec, reporter_records, train_worker

from .common import stats, value_row

TINY = PRESETS["tiny"]
# The tiny 3D layout the lead's acceptance run uses: 8 processes, one optimizer step of 8 x 64 tokens.
PLAN_3D = Plan(tp=2, pp=2, dp=2, micro_batches=2, global_batch=8, seq_len=64)


_CACHE: dict = {}  # one `python -m benchmarks` run measures the 3D layout once for two tables


def measure_train(cfg: ModelConfig, plan: Plan, steps: int = 8, warmup: int = 2,
                  timeout: float = 300.0, probe: int = 0, collect: tuple = ()) -> dict:
    """Step times (s) of `steps` timed optimizer steps after `warmup` untimed ones, and tokens/s
    (cached per process: the same run asked twice is measured once). `probe` > 0: the same
    processes first run that many host-probe units (`mini3d.cost.host_probe`), summarised under
    "probe"; `collect`: `RunConfig.collect`, every rank's result under "results"."""
    key = (cfg, plan, steps, warmup, probe, collect)
    if key not in _CACHE:
        _CACHE[key] = _measure(cfg, plan, steps, warmup, timeout, probe, collect)
    return _CACHE[key]


def probe_then_train(repeats: int, run) -> dict:
    """A launched rank: half the host-probe units, `train_worker`, the other half, in the same
    processes: the probe brackets the measured steps, so it sees the load they saw."""
    before = probe_worker((repeats + 1) // 2)
    out = train_worker(run)
    after = probe_worker(repeats // 2)
    merged = {k: before[k] + after[k] if isinstance(before[k], list) else (before[k] + after[k]) / 2
              for k in before}  # lists joined, per-op CPU seconds averaged
    return {**out, "probe": merged}


def _measure(cfg, plan, steps, warmup, timeout, probe=0, collect=()) -> dict:
    spec = make_spec(cfg, plan, steps=steps + warmup, seed=0, collect=collect)
    fn, args = (probe_then_train, (probe, spec)) if probe else (train_worker, (spec,))
    results = launch(fn, plan.world_size, *args, device="cpu", timeout=timeout)
    extra = {"probe": summarise([r["probe"] for r in results])} if probe else {}
    if collect:
        extra["results"] = results
    times = [r["step_time_s"] for r in reporter_records(results)[warmup:]]
    tokens = plan.global_batch * plan.seq_len
    return {"times": times, "tokens_per_step": tokens, **stats(times),
            "tokens_per_s": tokens / statistics.median(times),
            "tokens_per_s_all": [tokens / t for t in times], **extra}


def tokens_row(label: str, m: dict, note: str = "") -> dict:
    tps = m["tokens_per_s_all"]
    return value_row(label, m["tokens_per_s"], "tokens/s", note=note, min=min(tps),
                     median=statistics.median(tps), max=max(tps), step_s=m["median"])


def run(quick: bool = True) -> list[dict]:
    """One row: tokens/s of the tiny model on tp2 x pp2 x dp2 (8 processes, 1F1B, 2 micro-batches)."""
    m = measure_train(TINY, PLAN_3D, steps=5 if quick else 12)
    return [tokens_row("tiny 3D run tp2 pp2 dp2 (1f1b, m=2, 8x64 tokens/step)", m,
                       note=f"{len(m['times'])} timed steps, 8 processes on this machine")]
