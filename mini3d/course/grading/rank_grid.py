"""Checks of the exercise rank_grid (chapter 06): coordinates and groups, against `mini3d.grid.Grid`.
"""

from __future__ import annotations

from mini3d.course.grading.core import Check, Exercise, expect


def _shapes(rng):
    """Four (tp, pp, dp) grids; the first has every axis > 1, so an answer that swaps the order of
    two axes (pp slowest, not dp) fails on every seed, not only on seeds that happen to draw one."""
    full = (rng.choice([2, 4]), rng.choice([2, 3]), rng.choice([2, 3]))
    return [full] + [(rng.choice([1, 2, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3])) for _ in range(3)]


def coords_ok(ctx):
    from mini3d.grid import Grid

    for tp, pp, dp in _shapes(ctx.rng):
        g = Grid(tp, pp, dp)
        for r in range(g.world_size):
            got = ctx.impl.coords(r, tp, pp, dp)
            expect(got == g.coords(r), f"coords({r}, tp={tp}, pp={pp}, dp={dp})", g.coords(r), got)


def groups_of(axis):
    def check(ctx):
        from mini3d.grid import Grid

        for tp, pp, dp in _shapes(ctx.rng):
            want = Grid(tp, pp, dp).groups(axis)
            got = ctx.impl.rank_groups(tp, pp, dp, axis)
            expect(got == want, f"rank_groups(tp={tp}, pp={pp}, dp={dp}, {axis!r})", want, got)
    return check


EXERCISES = [
    Exercise("rank_grid", "06 3D parallelism", [
        Check("coords", 2, coords_ok, "rank -> (tp, pp, dp)"),
        Check("tp_groups", 1, groups_of("tp"), "tensor-parallel groups"),
        Check("dp_groups", 1, groups_of("dp"), "data-parallel groups"),
        Check("pp_groups", 1, groups_of("pp"), "pipeline groups"),
    ]),
]
