"""Exercise rank_grid: world rank <-> (tp, pp, dp) coordinates, and the groups of each axis.

Chapter: 06 3D parallelism (course/06_3d_parallelism.ipynb)
"""
from __future__ import annotations

def coords(rank: int, tp: int, pp: int, dp: int) -> dict:
    """{'tp': i, 'pp': j, 'dp': k} of `rank` when tp varies fastest, then dp, then pp (slowest):
    rank = tp_rank + tp * (dp_rank + dp * pp_rank)."""
    raise NotImplementedError('like digits of a mixed-radix number: peel off the fastest-varying coordinate first')

def rank_groups(tp: int, pp: int, dp: int, axis: str) -> list[list[int]]:
    """Every group along `axis` ("tp", "pp" or "dp"): the ranks that differ only in that coordinate,
    each group ordered by that coordinate, the list of groups sorted by first rank."""
    raise NotImplementedError('group ranks that share the two other coordinates; order each group by its own coordinate')
