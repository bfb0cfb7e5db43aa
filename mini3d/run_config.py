"""The run configuration: everything a training worker needs, as one frozen, typed object.

`RunConfig` sits next to `ModelConfig` (the model's shape) and `Plan` (the parallel layout): it holds
those two plus the run options (steps, optimizer, data, logging, checkpoints, diagnostics). The CLI,
the tests and the notebooks all build it the same way, `make_spec(cfg, plan, steps=..., ...)` (or
`RunConfig(model=cfg, plan=plan, ...)`), and every rank's `train_worker(run)` reads it. It is made of
plain frozen dataclasses, strings and numbers, so it pickles for `spawn` and for torchrun alike.

Validation happens once: `problems(world_size)` lists every offending value with what would fit (the
CLI prints them and exits 2 before any process starts); `validate()` raises `PlanError` with them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import ModelConfig, Plan, PlanError

COLLECTABLE = ("events", "timeline", "ledger", "activations")


@dataclass(frozen=True)
class RunConfig:
    """One training run: the model, the plan, and how to run, log, save and diagnose it."""

    model: ModelConfig  # the model's shape
    plan: Plan  # the parallel layout and batch shape
    steps: int = 20  # optimizer steps to reach (the total, also when resuming)
    lr: float = 3e-3  # AdamW learning rate
    seed: int = 0  # seeds the weights and the batches (batches are a function of (seed, step))
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    grad_clip: float = 0.0  # clip the global gradient norm to this (0: off)
    data: str | None = None  # a text file (byte tokens); None: the embedded corpus
    log_jsonl: str | None = None  # file for one JSON object per optimizer step (reporting rank)
    progress: bool = False  # show a progress bar on the reporting rank
    save: str | None = None  # checkpoint root directory (saved at the end and every save_every)
    save_every: int = 0  # also save every N steps (0: only at the end)
    resume: str | None = None  # a checkpoint directory to continue from (any layout)
    collect: tuple = ()  # extra measurements to return: events, timeline, ledger, activations
    run_dir: str | None = None  # where ranks dump diagnostics (hangs, faults)
    hang_timeout: float = 300.0  # seconds an op may pend before it counts as a hang
    inject_fault: str | None = None  # KIND:RANK:STEP[:ARG], a fault drill (mini3d.diagnose)
    memory_budget: str | None = None  # per-rank memory cap such as "512MiB" (checked at step 1)
    estimated: dict | None = None  # the estimator's bytes per category, for fault reports

    def __post_init__(self):
        object.__setattr__(self, "collect", tuple(self.collect or ()))

    def problems(self, world_size: int | None = None) -> list[str]:
        """Every reason this run cannot start, each naming the value and what would fit."""
        from .data import check_data_path

        out = self.plan.problems(self.model, world_size)
        if self.steps < 1:
            out.append(f"steps={self.steps} must be >= 1")
        if self.lr <= 0:
            out.append(f"lr={self.lr} must be > 0")
        if self.weight_decay < 0:
            out.append(f"weight_decay={self.weight_decay} must be >= 0")
        if self.grad_clip < 0:
            out.append(f"grad_clip={self.grad_clip} must be >= 0 (0 turns clipping off)")
        if self.save_every < 0:
            out.append(f"save_every={self.save_every} must be >= 0")
        unknown = [c for c in self.collect if c not in COLLECTABLE]
        if unknown:
            out.append(f"collect={unknown} is unknown (choose from {', '.join(COLLECTABLE)})")
        data_problem = check_data_path(self.data)
        if data_problem:
            out.append(data_problem)
        if self.model.vocab_size < 256:
            out.append(f"vocab_size={self.model.vocab_size} is smaller than the byte vocabulary (256)")
        return out

    def validate(self, world_size: int | None = None) -> "RunConfig":
        problems = self.problems(world_size)
        if problems:
            raise PlanError(problems)
        return self

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def model_dict(self) -> dict:
        return dataclasses.asdict(self.model)

    def diagnostics_spec(self) -> dict:
        """What `mini3d.diagnose.session.diagnostics` reads."""
        return dict(model=self.model_dict(), plan=self.plan.to_dict(), run_dir=self.run_dir,
                    hang_timeout=self.hang_timeout, inject_fault=self.inject_fault,
                    memory_budget=self.memory_budget, estimated=self.estimated)


def make_spec(cfg: ModelConfig, plan: Plan, **options) -> RunConfig:
    """A validated `RunConfig` for `cfg` and `plan`; `options` are its fields (a typo is a
    TypeError naming it, a bad value a PlanError naming it)."""
    return RunConfig(model=cfg, plan=plan, **options).validate()


__all__ = ["RunConfig", "make_spec", "COLLECTABLE"]
