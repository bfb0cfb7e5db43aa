"""PyTorch's flight recorder (NCCL's, and gloo's in torch >= 2.8), as `mini3d explain-hang` reads it.

`nccl_env` turns the recorder on for the job (the last 2000 collectives of each rank, on NCCL and on
gloo) and points NCCL's own dumps at RUN_DIR/nccl_trace_rank_<rank>, which PyTorch writes when a
collective times out. mini3d's watchdog ends the ranks before that timeout, so before a rank exits
on a detected hang (or the job's abort) it asks torch for the record itself (`write_dump`: torch's
`_dump_nccl_trace` on NCCL, `_dump_fr_trace` on gloo) and writes it to the same file.
Each dump is a pickled dict (`torch.distributed.flight_recorder.components.loader.read_dump` reads
the same): "version", "pg_config" and "entries", one dict per collective or p2p op with, among
others, "process_group" (name, description), "collective_seq_id" (per process group, equal across
its members for the same collective), "p2p_seq_id", "profiling_name" (e.g. "nccl:all_reduce"),
"state" ("scheduled", "started" or "completed"; gloo's stays "scheduled" and marks a finished op
"retired" instead), "input_sizes" and "is_p2p".

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

from mini3d.diagnose.save_clock import pg_timeout_s

FLIGHT_RECORDER_PREFIX = "nccl_trace_rank_"  # + world rank: PyTorch's flight recorder dump files
BUFFER = "2000"  # the recorder keeps this many of each rank's latest ops


def nccl_env(hang_timeout: float, run_dir: str, backend: str = "nccl",
             save_bytes: int = 0) -> dict[str, str]:
    """Environment for the process group's timeout and the flight recorder (every backend) and,
    on NCCL, for PyTorch's NCCL watchdog (set before the process group is created).

    Our watchdog fires at `hang_timeout`; the process-group timeout and NCCL's heartbeat monitor are
    set a minute later so that the mini3d dump (in plan terms) comes first and NCCL's own second;
    a run that saves checkpoints of `save_bytes` gets a process-group timeout past the save's bound
    too (diagnose/save_clock.py), so that a slow save's barriers do not time out."""
    from mini3d.launch.launcher import PG_TIMEOUT_ENV

    buffer, _ = _names()
    base = {PG_TIMEOUT_ENV: str(pg_timeout_s(hang_timeout, save_bytes)),
            buffer: BUFFER,  # gloo records too (torch >= 2.8); `write_dump` asks for the record
            **recorder_env(run_dir)}  # where NCCL writes its own
    if backend != "nccl":
        return base
    return {
        **base,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # write the recorder when a collective times out
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a timed-out collective tears the process down
        "TORCH_NCCL_ENABLE_MONITORING": "1",  # heartbeat monitor for a stuck NCCL watchdog
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(hang_timeout) + 60),
        # Not TORCH_NCCL_DESYNC_DEBUG: it turns on a start event and timing for every collective
        # and has the watchdog write each op's start and end to the store (a store round trip per
        # collective per rank, which grows with the job). mini3d's watchdog and the flight
        # recorder above already name the rank that did not join; a user who wants NCCL's own
        # desync report sets the variable, and it passes through to the ranks.
    }


def _names() -> tuple[str, str]:
    """(buffer size, dump file) variables: renamed TORCH_FR_* in torch 2.7 (old names warn)."""
    import torch

    new = tuple(int(x) for x in torch.__version__.split(".")[:2] if x.isdigit()) >= (2, 7)
    return (("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE") if new else
            ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))


def recorder_env(run_dir: str) -> dict[str, str]:
    """The variable that points torch's own (automatic, on a timeout) dumps at RUN_DIR. Under
    torchrun the job's directory RUN_DIR/job-<id> is known only after the process group exists
    (the ranks agree on the id through it): `mini3d.diagnose.torchrun.agree_on_job` sets it again
    then, and torch, which reads it when it first writes a dump, follows."""
    return {_names()[1]: os.path.join(run_dir, FLIGHT_RECORDER_PREFIX)}


def recorder_path() -> str | None:
    """Where torch would write this rank's automatic dump now (the prefix; None: its default)."""
    return os.environ.get(_names()[1])


def write_dump(run_dir: str, rank: int, backend: str | None = None) -> str | None:
    """Ask torch for this rank's flight recorder and write it to RUN_DIR/nccl_trace_rank_<rank>;
    the path, or None when this torch or backend records nothing (the recorder off, no entries).
    Never raises: the caller is a rank about to exit on a hang."""
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
        # NCCL's recorder (CUDA events) and gloo's (CPU events) are two: ask the one in use
        fn = getattr(c10d, "_dump_nccl_trace" if backend == "nccl" else "_dump_fr_trace", None)
        raw = fn() if fn is not None else None
        if not raw or not pickle.loads(raw).get("entries"):  # torch's own bytes, this process
            return None
        path = os.path.join(run_dir, f"{FLIGHT_RECORDER_PREFIX}{rank}")
        with open(path + ".tmp", "wb") as f:
            f.write(raw)
        os.replace(path + ".tmp", path)
        return path
    except Exception:  # a dump is a bonus: it must never keep a hung rank from exiting
        return None


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
    op = re.sub(r"^(nccl|gloo):", "", str(entry.get("profiling_name", "?")))
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    return f"{op} #{seq} on process group {pg[0]} ({pg[1]})"


def oldest_unfinished(dump: dict) -> dict | None:
    """The first recorded op neither "completed" nor retired (None: all finished)."""
    return next((e for e in dump["entries"]
                 if e.get("state") != "completed" and not e.get("retired")), None)


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
    lines = [f"torch's flight recorder ({FLIGHT_RECORDER_PREFIX}<rank> from ranks {sorted(dumps)}):"]
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


__all__ = ["nccl_env", "recorder_env", "recorder_path", "write_dump", "read_dumps", "oldest_unfinished", "highest_seq", "behind", "summary_lines"]
