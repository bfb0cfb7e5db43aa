"""Workers for tests/test_host_syncs.py (spawned by mini3d.launch.launcher: importable, top level).

`count_syncs(spec)` runs `train_worker(spec)` while counting, per optimizer step of its loop, the
calls that make the host wait for the device on a GPU: a scalar read (`.item()`, `float(t)`,
`int(t)`, `bool(t)`: all reach `aten._local_scalar_dense`), `.tolist()`, and the data-dependent
ops whose output size the host must learn (`nonzero`, `masked_select`, `unique`). On CPU nothing
waits, but the count is the same program's: a step that adds one adds it on CUDA too. Reads of
the optimizer's own step counters (torch keeps them on the host unless `capturable`) and the input
pipeline's (mini3d/data/: it indexes the token files with host tensors by construction, before
anything reaches the device) are left out.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique",
            "aten.unique")


class SyncCounter(TorchDispatchMode):
    """Counts host syncs (see the module docstring) and host-to-device constants (`torch.tensor`
    of Python numbers: a pageable copy on CUDA, `aten.lift_fresh`)."""

    def __init__(self):
        super().__init__()
        self.syncs, self.constants, self.where, self.in_tolist = 0, 0, [], False
        self.host_scalars: set = set()  # ids of the optimizer's step tensors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        if any(name.startswith(op) for op in SYNC_OPS) and not (
                args and id(args[0]) in self.host_scalars):
            self.count(_caller())
        elif name.startswith("aten.lift_fresh"):
            self.constants += 1
        return func(*args, **(kwargs or {}))

    def count(self, where: str):
        if not _host_side(where):
            self.syncs += 1
            self.where.append(where)


def _caller() -> str:
    """The innermost mini3d frame that asked (file:line), for the failure message."""
    import traceback

    frames = [f for f in traceback.extract_stack()[:-2] if "/mini3d/" in f.filename
              and "sync_workers" not in f.filename]
    return f"{frames[-1].filename.split('/mini3d/')[-1]}:{frames[-1].lineno}" if frames else "?"


def _host_side(where: str) -> bool:
    return where.startswith("data/")


def count_syncs(specs) -> list[list[dict]]:
    """For each spec: per loop iteration (optimizer step), the syncs and constants it made."""
    import mini3d.run.train as train

    out = []
    for spec in specs:
        counter, marks = SyncCounter(), []
        real_step, real_tolist = train._train_step, torch.Tensor.tolist

        def step(run, st, i, extra):
            opt = st["trainer"].optimizer
            inner = getattr(opt, "inner", opt)
            counter.host_scalars = {id(s["step"]) for s in getattr(inner, "state", {}).values()
                                    if isinstance(s, dict) and "step" in s}
            marks.append((counter.syncs, counter.constants, len(counter.where)))
            return real_step(run, st, i, extra)

        def tolist(t):  # once per call: under a torch-function mode (strict devices) it re-enters
            if counter.in_tolist:
                return real_tolist(t)
            counter.count(_caller())
            counter.in_tolist = True
            try:
                return real_tolist(t)
            finally:
                counter.in_tolist = False

        train._train_step, torch.Tensor.tolist = step, tolist
        try:
            with counter:
                train.train_worker(spec)
        finally:
            train._train_step, torch.Tensor.tolist = real_step, real_tolist
        marks.append((counter.syncs, counter.constants, len(counter.where)))
        out.append([{"syncs": b[0] - a[0], "constants": b[1] - a[1], "where": counter.where[a[2]:b[2]]}
                    for a, b in zip(marks, marks[1:])])
    return out
