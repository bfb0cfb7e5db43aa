"""The multi-process side of a distributed exercise, run on gloo by `mini3d.launch.launcher`.

`run_scenario(scenario, name, impl_name, seed)` runs in every rank: it builds a Topology, calls the
learner's code on inputs drawn from `seed` (each rank can regenerate every rank's inputs, so each
computes the single-process reference itself), and returns plain numbers. An exception inside one
case is returned as data, so one broken case costs only its own checks. `_read` and `_small` are the
parent-side helpers the checks use to judge those numbers.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from mini3d.course.grading.core import CheckFailed, expect, load_impl


# axis name -> a Topology built in advance: a caller that runs many scenarios in one launch (on a
# sub-group of its ranks, tests/grader_variants/batch.py) installs it here; empty otherwise
PREBUILT: dict = {}


def _topo(axis_name: str):
    from mini3d.grid import Grid, build_topology

    if axis_name in PREBUILT:
        return PREBUILT[axis_name]

    world = dist.get_world_size()
    grid = Grid(**{axis_name: world})
    return build_topology(grid, dist.get_rank())


def _gen(seed, *salt):
    """A generator every rank seeds identically (zlib, not hash(): str hashes differ per process)."""
    return torch.Generator().manual_seed(zlib.crc32(repr((seed,) + salt).encode()))


def _case(fn, *args):
    """Run one case; an exception becomes {"error": (type, message)}."""
    try:
        return fn(*args)
    except Exception as e:  # reported to the learner by the check that reads this case
        return {"error": (type(e).__name__, str(e))}


def run_scenario(scenario, name: str, impl_name: str, seed: int) -> dict:
    """Worker entry point: import `impl_name.name` and run `scenario(impl, seed)` in this rank."""
    torch.manual_seed(0)
    return scenario(load_impl(impl_name, name), seed)


def _read(ctx, case: str) -> list[dict]:
    """Every rank's record of one case; re-raise a learner exception as the check's failure."""
    recs = [r[case] for r in ctx.results]
    for rank, rec in enumerate(recs):
        if "error" in rec:
            kind, msg = rec["error"]
            if kind == "NotImplementedError":
                raise NotImplementedError(msg)
            if kind == "crash":  # the whole run of this case crashed (see runner.scenario_results)
                raise CheckFailed(msg)
            raise CheckFailed(f"rank {rank} raised {kind}: {msg}")
    return recs


def _small(recs, key, what, tol, expected="the single-process result"):
    worst = max(r[key] for r in recs)
    expect(worst <= tol, what, f"{expected} (within {tol:g})", f"max difference {worst:.3g}")
