"""A checkpoint save runs outside the hang clock, on a clock of its own.

`Trainer.save` is collective: every rank gathers its stage's tensors, keeps its share and writes it
(a sharded DCP checkpoint, mini3d/checkpoint/sharded.py), the ranks meeting in DCP's plan exchange
and mini3d's barriers. On a slow disk that takes far longer than `--hang-timeout`, and it is not a
hang. With `--async-save` the write runs in a background thread that the watchdog does not watch
(it issues no traced op; training's steps go on and keep the hang clock honest); the wait for it,
at the next save or at the end, runs inside `saving` like a save. So while a rank is inside `Watchdog.saving(nbytes, step)` its watchdog does not
apply the hang timeout to the ops the save issues; it applies the save's bound instead,

    bound = hang_timeout + SAVE_SLACK_S + nbytes / SAVE_RATE

where `nbytes` is the whole checkpoint (every rank's file: the writers share one file system), the
rate is a slow network disk's and the slack covers the gathers, fsyncs and renames. A save that
runs past its bound is still reported, as a stuck save:

- a rank with no op pending is doing the save's own work (writing its share, committing): past
  the bound its watchdog reports "stuck-save", naming itself, and stops the job (exit 3);
- a rank waiting in one of the save's barriers waits for the writers: it reports (a hang, naming the
  writers) only `waiter_grace` later, so that a stuck writer's own report comes first.

`MINI3D_SAVE_BOUND_S` replaces the computed bound (a disk known to be slower, or a test); the
process group's timeout is raised to cover the bound too (`pg_timeout_s`), so that neither gloo nor
NCCL ends the waiters' barrier first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SAVE_RATE = 20e6  # bytes/s a checkpoint write reaches at worst (a slow network file system)
SAVE_SLACK_S = 120.0  # seconds on top: the state's gathers, fsyncs, renames, a busy host
BYTES_PER_PARAM = 12  # a checkpoint holds each parameter's fp32 weight and two fp32 AdamW moments
BOUND_ENV = "MINI3D_SAVE_BOUND_S"  # seconds: replaces the computed bound


def checkpoint_bytes(n_params: int) -> int:
    """The bytes every rank's file of a checkpoint holds together (the full tensors, once)."""
    return BYTES_PER_PARAM * int(n_params)


def save_bound(nbytes: int, hang_timeout: float) -> float:
    """Seconds a save of `nbytes` may take before it counts as stuck (see the module docstring)."""
    if os.environ.get(BOUND_ENV):
        return float(os.environ[BOUND_ENV])
    return hang_timeout + SAVE_SLACK_S + nbytes / SAVE_RATE


def waiter_grace(bound: float) -> float:
    """How much longer than a writer a rank waiting for it gives the save before reporting."""
    return max(5.0, 0.1 * bound)


def pg_timeout_s(hang_timeout: float, save_bytes: int = 0) -> float:
    """The process group's timeout: a minute after the mini3d watchdog would report, whether the
    op is an ordinary one (`hang_timeout`) or a barrier of a save of `save_bytes` (its bound)."""
    late = hang_timeout
    if save_bytes:
        bound = save_bound(save_bytes, hang_timeout)
        late = max(late, bound + waiter_grace(bound))
    return int(late) + 60


@dataclass(frozen=True)
class SaveClock:
    """One save in progress on this rank: when it started (perf_counter), its bound, its size."""
    start: float
    bound: float
    nbytes: int
    step: int
    writers: tuple[int, ...]  # the ranks that write a share of the checkpoint (every rank)

    def overdue(self, now: float, waiting: bool) -> bool:
        """Past the bound (a rank doing the save's work), or past it and the grace (a waiter)."""
        return now - self.start > self.bound + (waiter_grace(self.bound) if waiting else 0.0)

    def as_dict(self, now: float) -> dict:
        return {"step": self.step, "bytes": self.nbytes, "bound_s": round(self.bound, 1),
                "age_s": round(now - self.start, 1), "writers": list(self.writers)}

    def describe(self, rank: int, now: float) -> str:
        return (f"rank {rank}'s checkpoint save of step {self.step} has run {now - self.start:.1f} s, "
                f"past its bound of {self.bound:.0f} s for {self.nbytes / 2**20:,.1f} MiB: a stuck "
                f"save (a slower disk? {BOUND_ENV}=SECONDS sets the bound)")


__all__ = ["SaveClock", "checkpoint_bytes", "save_bound", "waiter_grace", "pg_timeout_s",
           "SAVE_RATE", "SAVE_SLACK_S", "BOUND_ENV"]
