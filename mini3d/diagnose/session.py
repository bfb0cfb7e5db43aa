"""What a rank's training loop calls to be diagnosable: `diagnostics(topo, spec)`.

    diag = diagnostics(topo, spec)        # after build_topology: starts the hang watchdog
    for step in range(steps):
        diag.step_start(step, measure)    # injects the fault, if one was asked for
        ...
        diag.step_end(step)               # every op of the step issued (the black box's mark)
    with diag.saving(nbytes, step): ...   # a checkpoint save: its own bound, not hang_timeout
    diag.finish()                         # "finished" dump; stops the watchdog

A training run calls `for_run(topo, run)` with its RunConfig instead. `spec` keys (all optional): `run_dir` (no run_dir: no watchdog), `hang_timeout` (seconds, default
300), `inject_fault` ("KIND:RANK:STEP[:ARG]"), `memory_budget` (bytes or "512MiB"), `estimated`
(bytes per category, for the OOM report). The trainer and the comm-only drill use the same calls.
"""

from __future__ import annotations

import contextlib

from mini3d.diagnose.blackbox import BlackBox
from mini3d.diagnose.faults import FaultInjector, parse_fault, parse_size
from mini3d.diagnose.watchdog import start_watchdog


class Diagnostics:
    """The watchdog and the fault injector of one rank; every method is safe when both are off."""

    def __init__(self, topo, run_dir: str | None = None, hang_timeout: float = 300.0,
                 fault: str | None = None, memory_budget=None, estimated: dict | None = None):
        self.watchdog = start_watchdog(topo, run_dir, hang_timeout, fault) if run_dir else None
        budget = parse_size(memory_budget) if memory_budget not in (None, "") else None
        self.injector = (FaultInjector(parse_fault(fault), topo, budget, estimated)
                         if fault else None)

    def step_start(self, step: int, measure=None):
        """Mark the start of optimizer step `step`; `measure()` -> bytes per category (oom only)."""
        if self.injector is not None:
            self.injector.step_start(step, measure)

    def step_end(self, step: int):
        """Step `step` issued all its ops: the black box marks it whole (diagnose/blackbox.py)."""
        box = self.watchdog.topo.log.on_issue if self.watchdog is not None else None
        if isinstance(box, BlackBox):
            box.end_step(step)

    def saving(self, nbytes: int, step: int):
        """Context of a checkpoint save of `nbytes` (all stage files): on the save's clock."""
        return self.watchdog.saving(nbytes, step) if self.watchdog else contextlib.nullcontext()

    def finish(self):
        if self.watchdog is not None:
            self.watchdog.finish()


def diagnostics(topo, spec: dict) -> Diagnostics:
    """This rank's diagnostics as asked for by a worker spec (see the module docstring)."""
    estimated = spec.get("estimated")
    if estimated is None and spec.get("inject_fault") and "model" in spec and "plan" in spec:
        estimated = _estimate(spec, topo.pp.index)
    return Diagnostics(topo, spec.get("run_dir"), float(spec.get("hang_timeout") or 300.0),
                       spec.get("inject_fault"), spec.get("memory_budget"), estimated)


def for_run(topo, run) -> Diagnostics:
    """This rank's diagnostics for a training run (a `mini3d.run.config.RunConfig`), read from its
    objects: the estimate for a fault report comes from its ModelConfig and Plan themselves."""
    estimated = run.estimated
    if estimated is None and run.inject_fault:
        from mini3d.cost.memory import estimate_memory

        estimated = estimate_memory(run.model, run.plan, topo.pp.index).as_dict()
    return Diagnostics(topo, run.run_dir, float(run.hang_timeout), run.inject_fault,
                       run.memory_budget, estimated)


def _estimate(spec: dict, stage: int) -> dict | None:
    """The estimator's bytes per category for this rank's stage."""
    from mini3d.config import model_from_dict, plan_from_dict
    from mini3d.cost.memory import estimate_memory

    return estimate_memory(model_from_dict(spec["model"]), plan_from_dict(spec["plan"]),
                           stage).as_dict()


__all__ = ["Diagnostics", "diagnostics", "for_run"]
