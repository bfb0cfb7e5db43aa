"""Out-of-memory reports in terms of the plan: which rank and stage, which category, measured next to
estimated, and up to three plans that would fit.

Two triggers share one report (`faults.oom_report`):
* on CUDA, `torch.OutOfMemoryError` raised inside a training step is caught and explained (the
  measured model states come from the live ledger, the rest of the allocator's bytes is attributed to
  activations and buffers); with `MINI3D_MEMORY_SNAPSHOT=1` a CUDA memory snapshot is written to the
  run directory for https://pytorch.org/memory_viz;
* on any device, `--memory-budget SIZE` compares the measured ledgers after the first step (model
  states + activations saved for backward x the micro-batches in flight) with the budget, so a
  learner can meet an OOM on a laptop CPU.
"""

from __future__ import annotations

import dataclasses
import os

from mini3d.diagnose.faults import CATEGORIES, OutOfMemory


def plans_that_fit(cfg, plan, budget: int, n: int = 3) -> list[str]:
    """Up to `n` layouts of the same model, world size and batch whose estimate fits `budget` bytes."""
    from mini3d.cost.hardware import load_hardware
    from mini3d.cost.planner import describe, search

    hw = dataclasses.replace(load_hardware("A100-80GB"), name="budget", memory_bytes=budget)
    try:
        found = search(cfg, plan.world_size, hw, plan.global_batch, plan.seq_len, plan.dtype,
                       top_k=n, suggest=False, attention=plan.attention)
    except Exception:  # the planner is advice: never let it hide the OOM itself
        return []
    return [describe(c.plan) for c in found.candidates]


def estimate_for_report(cfg, plan, stage: int) -> dict:
    """The estimator's bytes per category with its `detail` (a MoE model's expert states and
    dispatch buffers get lines of their own in the report: `faults._expert_lines`)."""
    from mini3d.cost.memory import estimate_memory

    return estimate_memory(cfg, plan, stage).as_dict()


def estimated_bytes(cfg, plan, stage: int) -> dict:
    """The estimator's bytes per category only."""
    est = estimate_for_report(cfg, plan, stage)
    return {c: est[c] for c in CATEGORIES}


def check_budget(measured: dict, budget: int, rank: int, coords: dict, cfg, plan) -> None:
    """Raise `OutOfMemory` with the full report when the measured bytes exceed `budget`."""
    total = sum(measured.get(c, 0) for c in CATEGORIES)
    if total <= budget:
        return
    biggest = max(CATEGORIES, key=lambda c: measured.get(c, 0))
    raise OutOfMemory(rank, coords, biggest, 0, budget, measured,
                      estimate_for_report(cfg, plan, coords["pp"]), plans_that_fit(cfg, plan, budget))


def cuda_oom(err, measured_states: dict, device, rank: int, coords: dict, cfg, plan,
             run_dir: str | None) -> OutOfMemory:
    """An `OutOfMemory` explaining a `torch.OutOfMemoryError` caught in a CUDA training step."""
    from mini3d.launch.launcher import device_memory, dump_memory_snapshot

    stats = device_memory(device)
    allocated, capacity = stats["allocated"], stats["capacity"]
    measured = dict(measured_states)
    states = sum(measured.get(c, 0) for c in ("params", "grads", "optimizer"))
    measured["activations"] = max(0, allocated - states)
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        dump_memory_snapshot(os.path.join(run_dir, f"memory_snapshot_rank{rank}.pickle"))
    exc = OutOfMemory(rank, coords, "activations", 0, capacity, measured,
                      estimate_for_report(cfg, plan, coords["pp"]), plans_that_fit(cfg, plan, capacity))
    exc.report += f"\n(the CUDA allocator said: {str(err).splitlines()[0]})"
    exc.args = (exc.report,)
    return exc
