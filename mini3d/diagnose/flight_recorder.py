"""PyTorch's NCCL flight recorder, as `mini3d explain-hang` reads it.

On NCCL runs `watchdog.nccl_env` turns the recorder on (the last 2000 collectives of each rank) and
points its dumps at RUN_DIR/nccl_trace_rank_<rank>; PyTorch writes one when a collective times out.
Each dump is a pickled dict (`torch.distributed.flight_recorder.components.loader.read_dump` reads
the same): "version", "pg_config" and "entries", one dict per collective or p2p op with, among
others, "process_group" (name, description), "collective_seq_id" (per process group, equal across
its members for the same collective), "p2p_seq_id", "profiling_name" (e.g. "nccl:all_reduce"),
"state" ("scheduled", "started" or "completed"), "input_sizes" and "is_p2p".

What we read from them, per rank: the oldest op that had not completed (where that rank is stuck,
as NCCL saw it) and, per process group, the highest collective sequence number the rank reached.
A rank whose highest number on a group is below its peers' never issued the collective they wait
in: the same question mini3d's own dumps answer, asked of NCCL's record. torch's fr_trace tool does
a fuller cross-rank match; this is the one line explain-hang needs, without its dependencies.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import re

FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"  # + world rank: PyTorch's flight recorder dump files


def read_dumps(run_dir: str) -> dict[int, dict]:
    """{rank: dump} for every RUN_DIR/nccl_trace_rank_<rank> (pickle as torch writes it, or the
    JSON variant); unreadable files are skipped."""
    out = {}
    for path in glob.glob(os.path.join(run_dir, FLIGHT_RECORDER_PREFIX + "*")):
        m = re.search(r"(\d+)$", path)
        if not m:
            continue
        try:
            with open(path, "rb") as f:
                raw = f.read()
            try:
                dump = pickle.loads(raw)  # our own run directory: written by this job's ranks
            except Exception:
                dump = json.loads(raw)
        except (OSError, ValueError):
            continue
        if isinstance(dump, dict) and isinstance(dump.get("entries"), list):
            out[int(m.group(1))] = dump
    return out


def _name(entry: dict) -> str:
    pg = entry.get("process_group") or ("?", "?")
    op = str(entry.get("profiling_name", "?")).replace("nccl:", "")
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    return f"{op} #{seq} on process group {pg[0]} ({pg[1]})"


def oldest_unfinished(dump: dict) -> dict | None:
    """The first recorded op whose state is not "completed" (None: all completed)."""
    return next((e for e in dump["entries"] if e.get("state") != "completed"), None)


def highest_seq(dump: dict) -> dict[str, int]:
    """{process group name: highest collective_seq_id this rank issued there} (collectives only)."""
    out: dict[str, int] = {}
    for e in dump["entries"]:
        if not e.get("is_p2p"):
            pg = str((e.get("process_group") or ("?",))[0])
            out[pg] = max(out.get(pg, 0), int(e.get("collective_seq_id", 0)))
    return out


def behind(dumps: dict[int, dict]) -> list[tuple[int, str, int, int]]:
    """(rank, process group, its highest seq, the group's highest) for ranks behind their peers."""
    seqs = {r: highest_seq(d) for r, d in dumps.items()}
    out = []
    for pg in sorted({pg for s in seqs.values() for pg in s}):
        members = {r: s[pg] for r, s in seqs.items() if pg in s}
        top = max(members.values())
        out += [(r, pg, n, top) for r, n in sorted(members.items()) if n < top]
    return out


def summary_lines(run_dir: str) -> list[str]:
    """explain-hang's section on the NCCL flight recorder; [] when the run left no dumps."""
    dumps = read_dumps(run_dir)
    if not dumps:
        return []
    lines = [f"NCCL flight recorder ({FLIGHT_RECORDER_PREFIX}<rank> from ranks {sorted(dumps)}):"]
    for r, d in sorted(dumps.items()):
        e = oldest_unfinished(d)
        if e is None:
            lines.append(f"  rank {r}: all {len(d['entries'])} recorded ops completed")
        else:
            lines.append(f"  rank {r}: oldest unfinished op {_name(e)}, state {e.get('state')}, "
                         f"input sizes {e.get('input_sizes')}")
    for r, pg, n, top in behind(dumps):
        lines.append(f"  rank {r} is behind on process group {pg}: its last collective there is "
                     f"#{n}, its peers reached #{top} (it never issued the one they wait in)")
    return lines


__all__ = ["read_dumps", "oldest_unfinished", "highest_seq", "behind", "summary_lines"]
