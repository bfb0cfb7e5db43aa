"""Fault injection for teaching and testing: `--inject-fault KIND:RANK:STEP[:ARG]`.

Each kind reproduces one way a real 3D-parallel job fails, on rank RANK during optimizer step STEP
(counted from 0):

    crash      the rank dies at the start of the step (SIGKILL, as the kernel's OOM killer would)
    skip       the rank skips its first collective of the step (ARG: the axis, e.g. dp); its
               group's other members wait in an op it never enters
    shape      its first all_reduce, broadcast (as the source) or send of the step carries one
               extra row (ARG: the axis)
    p2p-order  its first send of the step becomes "recv first, then send": with a pipeline
               neighbour that also receives first, both wait forever (a real deadlock)
    a2a-split  its first all-to-all of token rows in the step (expert parallelism's dispatch,
               whose sizes the count exchange before it announced) sends one extra row to the
               next member of its ep group: the sizes it sends disagree with what that peer
               expects (gloo aborts the receiver; NCCL hangs or corrupts); needs ep >= 2
    slow       the rank sleeps ARG seconds (default 2) at the start of the step: a straggler; the
               job must finish with the right numbers, only later
    freeze     the rank stops itself (SIGSTOP) at the start of the step: a frozen process that
               neither answers nor dies, as a hung node or a debugger would leave it
    raise      the rank raises a RuntimeError at the start of the step: a bug in its own code
    oom        at the start of the step the rank asks for an activation buffer that takes it past
               `--memory-budget` (ARG: the size, default just past the budget): `OutOfMemory`

The collective faults act through `CommLog.fault`, the hook `mini3d.comm` calls before each op, so
they work under any layer above (trainer, pipeline runtime, raw comm tests). `oom` does not really
allocate: it checks the request against the budget first, as an allocator with a hard cap would.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass

import torch

from mini3d import comm
from mini3d.comm import COLLECTIVES
from mini3d.cost.memory import CATEGORIES
from mini3d.exits import EXIT_OOM, Mini3dError

KINDS = ("crash", "skip", "shape", "p2p-order", "a2a-split", "slow", "oom", "freeze", "raise")
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12,
          "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    rank: int  # world rank that misbehaves
    step: int  # optimizer step (from 0) at which it misbehaves
    arg: str | None = None  # axis for skip/shape, seconds for slow, size for oom

    def __str__(self) -> str:
        return f"{self.kind}:{self.rank}:{self.step}" + (f":{self.arg}" if self.arg else "")


def parse_fault(text: str) -> Fault:
    """'skip:1:2:dp' -> Fault('skip', 1, 2, 'dp'); ValueError naming the bad part otherwise."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] not in KINDS:
        raise ValueError(f"--inject-fault {text!r} must be KIND:RANK:STEP[:ARG] with KIND in "
                         f"{', '.join(KINDS)} (e.g. skip:1:2 or slow:0:1:3)")
    try:
        rank, step = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"--inject-fault {text!r}: RANK={parts[1]!r} and STEP={parts[2]!r} must be "
                         f"integers") from None
    if rank < 0 or step < 0:
        raise ValueError(f"--inject-fault {text!r}: RANK={rank} and STEP={step} must be >= 0")
    arg = parts[3] if len(parts) == 4 else None
    if parts[0] == "slow" and arg is not None:
        try:
            seconds = float(arg)
        except ValueError:
            raise ValueError(f"--inject-fault {text!r}: slow's ARG={arg!r} must be seconds") from None
        if not (seconds >= 0 and seconds < float("inf")):  # also refuses nan
            raise ValueError(f"--inject-fault {text!r}: slow's ARG={arg!r} must be a finite number "
                             f"of seconds >= 0")
    if parts[0] == "oom" and arg is not None:
        parse_size(arg)
    return Fault(parts[0], rank, step, arg)


def fault_problems(fault: Fault, plan, steps: int | None = None) -> list[str]:
    """Why `fault` cannot happen under `plan` (the rank does not exist, no group to misbehave in)."""
    out = []
    if fault.rank >= plan.world_size:
        out.append(f"--inject-fault {fault}: rank {fault.rank} does not exist (world size "
                   f"{plan.world_size})")
    if steps is not None and fault.step >= steps:
        out.append(f"--inject-fault {fault}: step {fault.step} is never reached (--steps {steps})")
    if fault.kind in ("skip", "shape") and plan.world_size == 1:  # (cp's ring counts: cp=2 is 2)
        out.append(f"--inject-fault {fault}: a single process issues no collective to {fault.kind}")
    if fault.kind == "p2p-order" and plan.pp < 2:
        out.append(f"--inject-fault {fault}: p2p-order needs pipeline neighbours (pp >= 2, got "
                   f"pp={plan.pp})")
    if fault.kind == "a2a-split" and getattr(plan, "ep", 1) < 2:
        out.append(f"--inject-fault {fault}: a2a-split needs expert parallelism's all-to-all "
                   f"(--ep >= 2 with --experts, got ep={getattr(plan, 'ep', 1)})")
    return out


def parse_size(text) -> int:
    """'512MiB', '2GB', '1e9' -> bytes; ValueError naming the text otherwise."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"size {text!r} is not understood (use e.g. 512MiB, 2GB or 1e9)")
    try:
        return int(float(m.group(1)) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"size {text!r} is not understood (use e.g. 512MiB, 2GB or 1e9)") from None


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


# What lowers each category per rank (chapters 03-07): the model states shard with ZeRO and split
# with tp and pp; only the activations answer to micro-batches and recomputation.
REMEDIES = {
    "params": "ZeRO-3, tp or pp",
    "grads": "ZeRO-2 or -3, tp or pp",
    "optimizer": "ZeRO-1 or higher, tp or pp",
    "activations": "more micro-batches, recompute, tp or pp",
    "comm_buffers": "smaller gradient buckets, bucket_mb",
}


def oom_report(rank: int, coords: dict, measured: dict, estimated: dict | None, budget: int,
               category: str, requested: int, fits: list[str] | None = None) -> str:
    """The OOM report: which rank, which category, measured vs estimated per category, what fits."""
    where = ", ".join(f"{k}={coords[k]}" for k in ("tp", "cp", "ep", "pp", "dp") if k in coords)
    total = sum(measured.get(c, 0) for c in CATEGORIES)
    doing = (f"allocating {_mib(requested)} of {category} with {_mib(total)} in use" if requested
             else f"{_mib(total)} measured in use, most of it {category},")
    lines = [f"OUT OF MEMORY on rank {rank} ({where}): {doing} exceeds the memory budget of "
             f"{_mib(budget)}",
             f"  {'category':<13}{'measured':>14}{'estimated':>14}"]
    moe = _expert_lines(estimated)
    for c in CATEGORIES:
        est = _mib(estimated[c]) if estimated and c in estimated else "-"
        mark = ("   <- this allocation" if requested else "   <- largest") if c == category else ""
        lines.append(f"  {c:<13}{_mib(measured.get(c, 0)):>14}{est:>14}{mark}")
        lines += moe.get(c, [])
    est_total = _mib(sum(estimated.get(c, 0) for c in CATEGORIES)) if estimated else "-"
    lines.append(f"  {'total':<13}{_mib(total + requested):>14}{est_total:>14}   (with the request)")
    if fits:
        lines.append("plans that would fit: " + "; ".join(fits))
    else:
        lines.append(f"to fit: lower {category} ({REMEDIES.get(category, 'tp or pp')}"
                     + ("; the expert states also with a larger ep" if moe else "")
                     + ") or raise the budget; `mini3d plan` lists plans that fit")
    return "\n".join(lines)


def _expert_lines(estimated: dict | None) -> dict[str, list[str]]:
    """A MoE model's share of the estimate on lines of its own (from the estimator's `detail`,
    `mini3d.cost.memory.estimate_stage`): the routed experts' states this rank holds (part of
    params, grads and optimizer; E/ep experts, ZeRO-sharded over edp) and expert parallelism's
    dispatch buffers (part of comm_buffers: `mini3d.cost.moe.a2a_buffer_bytes`). Estimated only:
    the live ledger does not split the categories. {category: the lines to print below it}."""
    detail = (estimated or {}).get("detail") or {}
    experts, ep = detail.get("experts") or {}, (detail.get("comm_buffers") or {}).get("ep", 0)
    out = {}
    if experts.get("total"):
        out["optimizer"] = [f"  {'  experts':<13}{'-':>14}{_mib(experts['total']):>14}   (of the three "
                            f"above: the states of {experts.get('n_params', 0):,} expert parameters)"]
    if ep:
        out["comm_buffers"] = [f"  {'  a2a bufs':<13}{'-':>14}{_mib(ep):>14}   (of comm_buffers: the "
                               f"ep dispatch's send and receive rows)"]
    return out


class OutOfMemory(Mini3dError, RuntimeError):
    """An allocation would exceed the memory budget; carries the category and the numbers."""

    exit_code = EXIT_OOM

    def __init__(self, rank: int, coords: dict, category: str, requested: int, budget: int,
                 measured: dict, estimated: dict | None = None, fits: list[str] | None = None):
        self.rank, self.coords, self.category = rank, coords, category
        self.requested, self.budget, self.measured, self.estimated = requested, budget, measured, estimated
        self.report = oom_report(rank, coords, measured, estimated, budget, category, requested, fits)
        super().__init__(self.report)

    def as_dict(self) -> dict:
        return {"rank": self.rank, "coords": self.coords, "category": self.category,
                "requested": self.requested, "budget": self.budget, "measured": self.measured,
                "estimated": self.estimated, "report": self.report}


class FaultInjector:
    """Makes one rank misbehave once; install as `topo.log.fault` and call `step_start` each step."""

    def __init__(self, fault: Fault, topo, memory_budget: int | None = None, estimated=None):
        self.fault, self.topo, self.memory_budget, self.estimated = fault, topo, memory_budget, estimated
        self.step = -1
        self.fired = False
        self.mine = topo.rank == fault.rank
        topo.log.fault = self

    @property
    def armed(self) -> bool:
        return self.mine and not self.fired and self.step == self.fault.step

    def step_start(self, step: int, measure=None):
        """Call at the start of each optimizer step; `measure()` -> bytes per category (for oom)."""
        self.step = step
        if not self.armed:
            return
        kind = self.fault.kind
        if kind == "crash":
            self.fired = True
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "freeze":
            self.fired = True
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "raise":
            self.fired = True
            raise RuntimeError(f"injected fault {self.fault}: rank {self.topo.rank} raised in step {step}")
        elif kind == "slow":
            self.fired = True
            time.sleep(float(self.fault.arg or 2.0))
        elif kind == "oom":
            self.fired = True
            self._oom(measure() if measure else dict.fromkeys(CATEGORIES, 0))

    def _oom(self, measured: dict):
        in_use = sum(measured.get(c, 0) for c in CATEGORIES)
        budget = self.memory_budget if self.memory_budget is not None else in_use + 2**20
        requested = parse_size(self.fault.arg) if self.fault.arg else max(budget - in_use, 0) + 2**20
        if in_use + requested > budget:
            raise OutOfMemory(self.topo.rank, self.topo.coords, "activations", requested, budget,
                              measured, self.estimated)

    def _wants(self, ev) -> bool:
        kind, axis = self.fault.kind, self.fault.arg
        if axis and kind in ("skip", "shape") and ev.axis != axis:
            return False
        if kind == "skip":
            return ev.op in COLLECTIVES
        if kind == "shape":  # an op whose wrong size a peer notices: gloo lets a broadcast's
            # receiver (or a recv) take a message shorter than its buffer, so not those
            return ev.op in ("all_reduce", "send") or (ev.op == "broadcast" and ev.wire_bytes > 0)
        if kind == "a2a-split":  # token rows (floating), not the integer count table announcing them
            return ev.op == "all_to_all" and not ev.dtype.startswith(("int", "uint"))
        return kind == "p2p-order" and ev.op == "send"

    def __call__(self, ev, tensor: torch.Tensor):
        """The `CommLog.fault` hook: called with (event, tensor) before each op is issued."""
        if not self.armed or not self._wants(ev):
            return tensor
        self.fired = True
        kind = self.fault.kind
        if kind == "skip":
            return comm.SKIP
        if kind in ("shape", "a2a-split"):
            out = self._extra_row(ev, tensor)
            ev.shape = tuple(out.shape)  # what is issued: the black box records it again
            if self.topo.log.on_issue is not None:
                self.topo.log.on_issue(ev)
            return out
        axis = self.topo.axes[ev.axis]  # p2p-order: receive first, then send (if ever)
        comm.recv(torch.empty_like(tensor), axis, ev.peer)
        return tensor

    def _extra_row(self, ev, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` with one row more: at the end (shape), or at the end of the block for the
        next member of the group, whose input split grows by one (a2a-split: `ev.splits` then
        holds what is sent, the peer's output split what it expects)."""
        if self.fault.kind == "shape":
            flat = tensor.reshape(-1)
            return torch.cat([flat, flat[:1]]) if tensor.dim() <= 1 else torch.cat([tensor, tensor[:1]])
        ins, outs = list(ev.splits[0]), ev.splits[1]
        peer = (ev.group.index(self.topo.rank) + 1) % len(ev.group)
        end = sum(ins[:peer + 1])
        row = tensor[end - 1:end] if ins[peer] else tensor.new_zeros((1,) + tuple(tensor.shape[1:]))
        ins[peer] += 1
        ev.splits = (tuple(ins), outs)
        return torch.cat([tensor[:end], row, tensor[end:]])


__all__ = ["Fault", "FaultInjector", "KINDS", "OutOfMemory", "fault_problems",
           "oom_report", "parse_fault", "parse_size"]
