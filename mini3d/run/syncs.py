"""Host syncs per optimizer step, counted from the running code (issue #34: at most one a step).

`SyncCounter` is a TorchDispatchMode that counts what makes the host wait for a GPU: a scalar read
(`.item()`, `float(t)`, `int(t)`, `bool(t)`: all reach `aten._local_scalar_dense`), `.tolist()`
(patched: it reaches no op), and the data-dependent ops whose output size the host must learn
(`nonzero`, `masked_select`, `unique`); it also counts host-to-device constants (`torch.tensor`
of Python numbers, `aten.lift_fresh`: a pageable copy on CUDA). On CPU nothing waits, but the
count is the same program's, so a step that adds a sync adds it on CUDA too. Left out: reads of
the optimizer's own step counters (torch keeps them on the host unless `capturable`) and of the
input pipeline (mini3d/data/ indexes the token files with host tensors by construction).

`count_syncs(specs)` runs `mini3d.run.train.train_worker` on each spec under the counter and
returns, per loop iteration, the syncs, constants and the mini3d file:line of each sync.
(tests/test_host_syncs.py; benchmarks/gpu_extras.py adds torch's own CUDA sync debug mode.)
"""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique",
            "aten.unique")


def _caller() -> str:
    """The innermost mini3d frame that asked (file:line below mini3d/)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/mini3d/" in f.filename
              and not f.filename.endswith("run/syncs.py")]
    return f"{frames[-1].filename.split('/mini3d/')[-1]}:{frames[-1].lineno}" if frames else "?"


class SyncCounter(TorchDispatchMode):
    """Counts host syncs and host-to-device constants (see the module docstring)."""

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
        if not where.startswith("data/"):  # the input pipeline: host tensors by construction
            self.syncs += 1
            self.where.append(where)


def count_syncs(specs, device="cpu") -> list[list[dict]]:
    """For each spec: per loop iteration (optimizer step; the last one runs on to the loop's
    end), {"syncs", "constants", "where"}, and on CUDA "cuda_syncs": the synchronizing calls
    torch's own sync debug mode reported (`launch.devices.cuda_sync_warnings`)."""
    import mini3d.run.train as train
    from mini3d.launch.devices import cuda_sync_warnings

    out = []
    for spec in specs:
        counter, marks, cuda = SyncCounter(), [], []
        real_step, real_tolist = train._train_step, torch.Tensor.tolist

        def step(run, st, i, extra):
            opt = st["trainer"].optimizer
            inner = getattr(opt, "inner", opt)
            counter.host_scalars = {id(s["step"]) for s in getattr(inner, "state", {}).values()
                                    if isinstance(s, dict) and "step" in s}
            marks.append((counter.syncs, counter.constants, len(counter.where), len(cuda)))
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
            with cuda_sync_warnings(device) as cuda, counter:
                train.train_worker(spec)
        finally:
            train._train_step, torch.Tensor.tolist = real_step, real_tolist
        marks.append((counter.syncs, counter.constants, len(counter.where), len(cuda)))
        out.append([{"syncs": b[0] - a[0], "constants": b[1] - a[1], "where": counter.where[a[2]:b[2]],
                     "cuda_syncs": b[3] - a[3]} for a, b in zip(marks, marks[1:])])
    return out


__all__ = ["SyncCounter", "count_syncs", "SYNC_OPS"]
