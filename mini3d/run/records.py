"""What one training step measures and reports: the non-finite-loss stop, the measured memory in
the estimator's categories, the optional measurements a caller collects, and the lines and
records `mini3d train` prints (`describe_plan`, `summary_line`).
"""

from __future__ import annotations

import math
import resource

import torch

from mini3d.config import Plan
from mini3d.launch.devices import device_memory
from mini3d.dp import model_state_ledger
from mini3d.exits import EXIT_NONFINITE, Mini3dError
from mini3d.timeline_clock import clock_for


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA's allocator peak on GPUs, the process' peak RSS on CPU."""
    if device.type == "cuda":
        return device_memory(device)["peak"]
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class NonFiniteLoss(Mini3dError, RuntimeError):
    """The loss became nan or inf: `mini3d train` stops with its own exit code (5)."""

    exit_code = EXIT_NONFINITE


def check_finite(loss: float, step: int, topo):
    """Raise NonFiniteLoss naming the step and the rank; every rank holds the same loss here (the
    pipeline broadcasts it, dp averages it), so all stop at the same point."""
    if not math.isfinite(loss):
        c = topo.coords
        raise NonFiniteLoss(f"the loss is {loss} at step {step + 1} (seen on rank {topo.rank}, "
                            f"tp={c['tp']}, pp={c['pp']}, dp={c['dp']}): training diverged; "
                            f"lower --lr, set --grad-clip, or check the data")


def peak_activation_bytes(trainer, acts: dict | None) -> float:
    """Measured activation peak: bytes saved per micro-batch x micro-batches in flight at once
    (1 without a pipeline: each micro-batch's backward frees them before the next forward)."""
    if not acts:
        return 0.0
    in_flight = max(trainer.last_result.peak_in_flight.values()) if trainer.last_result else 1
    return sum(acts.values()) * in_flight


def memory_by_category(trainer, activations: float = 0) -> dict:
    """Measured bytes of this rank in the estimator's categories (model states from the live
    ledger; activations as measured by the caller)."""
    led = model_state_ledger(trainer.net, trainer.optimizer)
    return {"params": led["parameters"], "grads": led["gradients"],
            "optimizer": led["master_weights"] + led["optimizer_states"] + led["optimizer_scalars"],
            "activations": activations, "comm_buffers": 0}


def collected(trainer, what: set) -> dict:
    """Optional measurements a caller (tests, the course) asks for with `RunConfig.collect`:
    "events" (this rank's comm event log), "timeline" (the last pipeline step's measured actions),
    "ledger" (model-state bytes by category), "activations" (bytes saved for backward per
    micro-batch by module, measured during the first step; one model chunk only), "save" (the last
    checkpoint save's host bytes: mini3d.checkpoint.sharded.ShareStats), "load" (what the resume
    read of a sharded checkpoint: bytes read, bytes stored, batches; dcp_read.LazyStates.stats).
    Times are seconds: what ran after the last step's read-back (a validation pass) is resolved first."""
    if what:
        resolve_timelines(trainer.topo.device)  # CUDA: a final wait, once a run; nothing on CPU
    out = {}
    if "events" in what:
        out["events"] = trainer.topo.log.snapshot()
    if "timeline" in what:  # pp = 1: the step's forwards and backwards (Trainer.last_timeline)
        tl = trainer.last_result.timeline if trainer.last_result else getattr(trainer, "last_timeline", [])
        out["timeline"] = [(s, e, a) for s, e, a in tl]
    if "ledger" in what:
        out["ledger"] = model_state_ledger(trainer.net, trainer.optimizer)
    if "save" in what and getattr(trainer, "last_save_stats", None) is not None:
        import dataclasses

        out["save_stats"] = dataclasses.asdict(trainer.last_save_stats)
    if "load" in what and getattr(trainer, "last_load_stats", None) is not None:
        out["load_stats"] = trainer.last_load_stats
    return out


def timed(timeline: list, action: str, fn, device="cpu"):
    """Run `fn()`, append (start, end, action) to `timeline` on `device`'s timeline clock, as the
    pipeline runtime records its actions (`mini3d.timeline_clock`: perf_counter seconds on CPU; on
    CUDA events, seconds once the step's read-back resolved them) and return what `fn` returned."""
    clock = clock_for(device)
    t0 = clock.mark()
    out = fn()
    clock.span(timeline, t0, action)
    return out


def resolve_timelines(device) -> None:
    """After the step's read-back: its timeline marks on `device` as seconds (a no-op on CPU; on
    CUDA the one `synchronize` that `mini3d.timeline_clock.CudaClock.resolve` makes a step)."""
    clock_for(device).resolve()


def describe_plan(plan: Plan) -> str:
    s = f"tp{plan.tp} x pp{plan.pp} x dp{plan.dp}"
    if plan.cp > 1:
        s = f"tp{plan.tp} x cp{plan.cp} x pp{plan.pp} x dp{plan.dp}"
    if plan.ep > 1:
        s += f" (ep{plan.ep} of them)"
    if plan.zero:
        s += f" zero{plan.zero}"
    if plan.pp > 1:
        s += f" {plan.schedule}"
    if plan.attention != "explicit":
        s += f" {plan.attention}"
    if plan.compile != "none":
        s += " compiled" + ("" if plan.compile == "inductor" else f":{plan.compile}")
    return s


def summary_line(records: list[dict], plan: Plan, device_type: str = "cpu") -> str:
    first, last = records[0], records[-1]
    n = len(records)
    mean_tps = sum(r["tokens_per_s"] for r in records[1:] or records) / max(1, len(records[1:] or records))
    val = [r["val_loss"] for r in records if "val_loss" in r]
    val_text = f", val loss {val[0]:.4f} -> {val[-1]:.4f}" if len(val) > 1 else (
        f", val loss {val[0]:.4f}" if val else "")
    what = "peak memory" if device_type == "cuda" else "peak memory (process RSS, not model bytes)"
    return (f"done: {n} steps on {describe_plan(plan)} ({plan.world_size} processes, {plan.dtype}): "
            f"loss {first['loss']:.4f} -> {last['loss']:.4f}{val_text}, {mean_tps:,.0f} tokens/s, "
            f"{what} {max(r['peak_mem_bytes'] for r in records) / 2**20:,.0f} MiB per rank")


def reporter_records(results: list[dict]) -> list[dict]:
    return next(r["records"] for r in results if r["reporter"])


__all__ = ["peak_memory_bytes", "NonFiniteLoss", "check_finite", "peak_activation_bytes", "memory_by_category", "collected",
           "describe_plan", "summary_line", "reporter_records", "timed", "resolve_timelines"]
