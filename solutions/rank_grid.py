"""Exercise rank_grid: world rank <-> (tp, pp, dp) coordinates, and the groups of each axis.

Chapter: 06 3D parallelism (course/06_3d_parallelism.ipynb)
"""

from __future__ import annotations


def coords(rank: int, tp: int, pp: int, dp: int) -> dict:
    """{'tp': i, 'pp': j, 'dp': k} of `rank` when tp varies fastest, then dp, then pp (slowest):
    rank = tp_rank + tp * (dp_rank + dp * pp_rank)."""
    return {"tp": rank % tp, "dp": (rank // tp) % dp, "pp": rank // (tp * dp)}


def rank_groups(tp: int, pp: int, dp: int, axis: str) -> list[list[int]]:
    """Every group along `axis` ("tp", "pp" or "dp"): the ranks that differ only in that coordinate,
    each group ordered by that coordinate, the list of groups sorted by first rank."""
    sizes = {"tp": tp, "pp": pp, "dp": dp}
    groups: dict = {}
    for r in range(tp * pp * dp):
        c = coords(r, tp, pp, dp)
        key = tuple(v for a, v in sorted(c.items()) if a != axis)
        groups.setdefault(key, [None] * sizes[axis])[c[axis]] = r
    return sorted(groups.values())
