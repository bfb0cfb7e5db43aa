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


def _fmt_s(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _fmt_r(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def row_cells(r: dict) -> list[str]:
    """[name, ours, theirs, ratio (min/median/max), note] for one row of any benchmark."""
    note = r.get("note", "") or ""
    if "measured_bubble" in r:
        note = (f"bubble measured {r['measured_bubble']:.3f} vs simulated {r['simulated_bubble']:.3f} "
                f"({r['gap_points']:.1f} pts; closed form {r['formula_bubble']:.3f}); ratio = "
                f"measured / simulated makespan") + (f"; {note}" if note else "")
    if "same_result" in r:
        note = "same output and input grad" if r["same_result"] else "RESULTS DIFFER"
    if "value" in r:
        spread = "/".join(f"{r[k]:,.0f}" for k in ("min", "median", "max") if k in r)
        return [r["name"], f"{r['value']:,.0f} {r['unit']}", "-", f"({spread})", note]
    lo, hi = r.get("ratio_min", r.get("min")), r.get("ratio_max", r.get("max"))
    if "measured_bubble" in r and r.get("theirs_s"):
        lo, hi = r["min"] / r["theirs_s"], r["max"] / r["theirs_s"]
    ratio = _fmt_r(r.get("ratio"))
    if lo is not None and hi is not None:
        ratio += f" ({lo:.2f}/{r.get('ratio_median', r.get('ratio')):.2f}/{hi:.2f})"
    if r.get("goal") is not None:
        note = f"goal {r['goal']}" + (f"; {note}" if note else "")
    return [r["name"], _fmt_s(r.get("ours_s")), _fmt_s(r.get("theirs_s")), ratio, note]


def markdown_table(rows: list[dict]) -> str:
    head = ["benchmark", "mini3d / measured", "reference", "ratio (min/median/max)", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [c.replace("|", "/").replace("\n", " ") for c in row_cells(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_description() -> dict:
    """CPU model, cores, torch version, date: the context every number in RESULTS.md needs."""
    import datetime
    import os
    import platform

    import torch

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "os": platform.platform(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_avg_1m": os.getloadavg()[0]}


def replace_section(path: str, key: str, text: str) -> None:
    """Write `text` between <!-- begin KEY --> / <!-- end KEY --> markers in `path` (appended when
    the section is new), so several scripts can own their own parts of one RESULTS.md."""
    import os

    begin, end = f"<!-- begin {key} -->", f"<!-- end {key} -->"
    old = open(path).read() if os.path.exists(path) else ""
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = (old.rstrip() + "\n\n" if old.strip() else "") + block
    with open(path, "w") as f:
        f.write(new)
