"""Shared helpers: timing statistics and the row format every benchmark returns."""

from __future__ import annotations

import statistics


def stats(times: list[float]) -> dict:
    return {"min": min(times), "median": statistics.median(times), "max": max(times)}


def ratio_row(name: str, ours: list[float], theirs: list[float], goal: float | None = None,
              note: str = "") -> dict:
    """A row comparing per-repeat times: ratio = ours / theirs, with min/median/max of the per-repeat
    ratios (each repeat times both sides back to back, so drifts of the machine hit both)."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    s = stats(ratios)
    return {"name": name, "ours_s": statistics.median(ours), "theirs_s": statistics.median(theirs),
            "ratio": s["median"], "ratio_min": s["min"], "ratio_max": s["max"], "goal": goal,
            "note": note}


def value_row(name: str, value: float, unit: str, note: str = "", **extra) -> dict:
    return {"name": name, "value": value, "unit": unit, "note": note, **extra}
