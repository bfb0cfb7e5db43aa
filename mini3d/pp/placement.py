"""Where a pipeline stage lives: `stage_rank(stage, p, placement)`.

Placement "loop" (Megatron's round-robin: rank r holds stages r, r+p, ...) or "v" (the ZB-V
schedule: chunk c of rank r is stage c p + r for even c, (c + 1) p - 1 - r for odd c, so rank 0
holds the first and the last stage). A module of its own, importing nothing, because the schedules,
the simulator, the partition and the memory estimator all read it (see mini3d/pp/partition.py).
"""

from __future__ import annotations

PLACEMENTS = ("loop", "v")


def stage_rank(stage: int, p: int, placement: str = "loop") -> int:
    """The pipeline rank that holds global stage `stage` (see the module docstring)."""
    if placement == "loop":
        return stage % p
    if placement == "v":
        chunk, i = divmod(stage, p)
        return i if chunk % 2 == 0 else p - 1 - i
    raise ValueError(f"placement={placement!r} is unknown (choose {', '.join(PLACEMENTS)})")


__all__ = ["PLACEMENTS", "stage_rank"]
