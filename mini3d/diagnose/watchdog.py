"""Hang watchdog: a thread per rank that turns a silent hang into one JSON dump per rank.

Every op issued through `mini3d.comm` sits in `topo.log.pending` until it completes: not until its
`wait()` returned, which on NCCL happens at once while the host blocks later (in `.item()`, outside
mini3d), but until its `Work` reports completion. Each poll the watchdog first asks the log to end
the ops whose Work has completed (`CommLog.reap`, which calls `is_completed()` from this thread),
then looks at the most recently issued op still pending (under `topo.log.lock`); when it has been
pending longer than `hang_timeout` seconds the watchdog

1. creates the job's abort marker `RUN_DIR/ABORT-<job id>` (atomically: the first rank to see a
   hang wins; another job sharing the run directory, or a stale marker, has another name),
2. dumps this rank's state to `RUN_DIR/rank{r}.json`: grid coordinates, `log.context` (step, action,
   micro-batch), the pending ops, the recent events and the per-(axis, op) sequence counters,
3. prints one line and ends the process with `HANG_EXIT`.

Every other rank's watchdog polls for the marker, dumps its own state (status "aborted") and exits
with `ABORTED_EXIT`, so all ranks get to dump, not only the first. The launcher writes the marker too
when a rank fails in another way (`launch(..., run_dir=...)`), and the watchdog dumps with status
"error" when the rank's own function raises (e.g. gloo's "Connection closed by peer" after a peer
died), "oom" for `OutOfMemory`, and "finished" when the rank returns normally. A rank killed by the
communication library itself (gloo aborts on a size mismatch) cannot dump; `faulthandler` then leaves
its Python stack in `rank{r}.stack`. `mini3d explain-hang RUN_DIR` reads all of these.

On CUDA, PyTorch's own NCCL flight recorder and timeouts are configured by `nccl_env`, the one place
that sets those variables (they must be in the environment before the process group is created);
the process group's own timeout follows `hang_timeout` too (`PG_TIMEOUT_ENV`, read by
mini3d.launch), a minute later, so that the mini3d dump comes first on every backend.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time

from .flight_recorder import FLIGHT_RECORDER_PREFIX
from .history import describe_op
from ..launch import ABORTED_EXIT, HANG_EXIT, abort_marker, on_failure

RECENT_EVENTS = 256  # events per dump: enough to align sequence numbers across a group


def nccl_env(hang_timeout: float, run_dir: str, backend: str = "nccl") -> dict[str, str]:
    """Environment for the process group's timeout (every backend) and, on NCCL, for PyTorch's
    NCCL watchdog and flight recorder (its dumps land in RUN_DIR/nccl_trace_rank_<r>, read by
    `mini3d explain-hang`).

    Our watchdog fires at `hang_timeout`; the process-group timeout and NCCL's heartbeat monitor are
    set a minute later so that the mini3d dump (in plan terms) comes first and NCCL's own second."""
    import torch

    from ..launch import PG_TIMEOUT_ENV

    base = {PG_TIMEOUT_ENV: str(int(hang_timeout) + 60)}
    if backend != "nccl":
        return base

    # the flight recorder's variables were renamed TORCH_FR_* in torch 2.7 (old names warn)
    new = tuple(int(x) for x in torch.__version__.split(".")[:2] if x.isdigit()) >= (2, 7)
    buffer, trace = (("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE") if new else
                     ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))
    return {
        **base,
        buffer: "2000",  # flight recorder: the last 2000 collectives per rank
        trace: os.path.join(run_dir, FLIGHT_RECORDER_PREFIX),  # where it is written
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # write the recorder when a collective times out
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a timed-out collective tears the process down
        "TORCH_NCCL_ENABLE_MONITORING": "1",  # heartbeat monitor for a stuck NCCL watchdog
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(hang_timeout) + 60),
        "TORCH_NCCL_DESYNC_DEBUG": "1",  # on timeout, report which rank did not join
    }


def _event_dict(ev, now: float, blocked) -> dict:
    d = ev.as_dict()
    d["group"] = list(d["group"])
    d["shape"] = list(d["shape"])
    d["pending"] = ev.end is None
    d["age_s"] = round(now - ev.start, 3)
    d["blocked"] = ev is blocked
    return d


class Watchdog:
    """One rank's hang watchdog (a daemon thread); `finish()` stops it and dumps "finished"."""

    def __init__(self, topo, run_dir: str, hang_timeout: float = 300.0, poll: float = 0.1,
                 fault: str | None = None):
        self.topo, self.run_dir, self.hang_timeout, self.poll = topo, run_dir, hang_timeout, poll
        self.fault = fault  # the injected fault, if any (metadata for teaching; not used to diagnose)
        self.rank = topo.rank
        self._stop = threading.Event()
        self._dumped = threading.Lock()  # held forever by the first dump: one dump per rank
        self._dump_done = threading.Event()  # set once that dump is on disk
        self._thread = threading.Thread(target=self._loop, name=f"mini3d-watchdog{self.rank}",
                                        daemon=True)
        self._stack_file = None

    @property
    def marker(self) -> str:
        return abort_marker(self.run_dir)  # this job's (MINI3D_JOB_ID): never another job's

    def start(self) -> "Watchdog":
        os.makedirs(self.run_dir, exist_ok=True)
        keep_library_noise_in(self.run_dir, self.rank)  # gloo's abort text: not the first line
        self._stack_file = open(os.path.join(self.run_dir, f"rank{self.rank}.stack"), "w")
        faulthandler.enable(file=self._stack_file, all_threads=True)  # SIGABRT/SIGSEGV stacks
        on_failure(self._on_error)
        self._thread.start()
        return self

    def finish(self):
        """The rank's function returned: stop watching and record a "finished" dump."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        self.dump("finished", "the rank's function returned")
        faulthandler.disable()
        if self._stack_file is not None:
            self._stack_file.close()
            path = self._stack_file.name
            if os.path.exists(path) and os.path.getsize(path) == 0:
                os.remove(path)

    # -- state and dump ---------------------------------------------------------------------
    def blocked_event(self):
        """The op this rank waits in: its most recently issued pending op (or None)."""
        with self.topo.log.lock:
            pending = list(self.topo.log.pending.values())
        return max(pending, key=lambda e: e.start) if pending else None


    def state(self, status: str, reason: str, extra: dict | None = None) -> dict:
        log, grid = self.topo.log, self.topo.grid
        now = time.perf_counter()
        blocked = self.blocked_event()
        with log.lock:
            pending = list(log.pending.values())
            recent = list(log.events)[-RECENT_EVENTS:]
        return {
            "rank": self.rank, "pid": os.getpid(), "status": status, "reason": reason,
            "coords": self.topo.coords, "grid": {**grid.sizes, "order": "-".join(grid.order),
                                                 "world_size": grid.world_size},
            "context": dict(log.context), "hang_timeout": self.hang_timeout, "fault": self.fault,
            "blocked": _event_dict(blocked, now, blocked) if blocked else None,
            "pending": [_event_dict(e, now, blocked) for e in pending],
            "events": [_event_dict(e, now, blocked) for e in recent],
            "seq": log.seq_counts(), "time": time.time(), **(extra or {}),
        }

    def dump(self, status: str, reason: str, extra: dict | None = None) -> str | None:
        """Write rank{r}.json once (atomically); later calls do nothing and return None."""
        if not self._dumped.acquire(blocking=False):
            # Another thread is writing this rank's dump (e.g. the main thread's error hook while
            # the watchdog aborts): let it finish before anyone ends the process.
            self._dump_done.wait(timeout=10)
            return None
        try:
            path = os.path.join(self.run_dir, f"rank{self.rank}.json")
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.state(status, reason, extra), f, indent=1, default=str)
            os.replace(tmp, path)
            return path
        finally:
            self._dump_done.set()

    def _on_error(self, exc: BaseException):
        report = getattr(exc, "report", None)
        status = "oom" if report is not None else "error"
        extra = {"oom": exc.as_dict()} if hasattr(exc, "as_dict") else None
        self.dump(status, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                  extra)

    # -- the thread ---------------------------------------------------------------------------
    def _loop(self):
        while not self._stop.wait(self.poll):
            if os.path.exists(self.marker):
                self._abort()
            self.topo.log.reap()  # end the ops whose Work completed after their wait returned
            ev = self.blocked_event()
            if ev is not None and time.perf_counter() - ev.start > self.hang_timeout:
                self._hang(ev)

    def _abort(self):
        try:
            with open(self.marker) as f:
                why = json.load(f)
        except (OSError, ValueError):
            why = {}
        self.dump("aborted", f"job aborted by {why.get('by', 'another rank')}: {why.get('reason', '')}")
        self._exit(ABORTED_EXIT, int(why.get("code", 1)) if isinstance(why, dict) else 1)

    def _hang(self, ev):
        where = describe_op(ev.as_dict())
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # another rank saw it first: we are one of the waiters
            return self._abort()
        with os.fdopen(fd, "w") as f:
            json.dump({"by": self.rank, "reason": f"rank {self.rank} hung in {where}", "code": 3}, f)
        age = time.perf_counter() - ev.start
        self.dump("hang", f"waited {age:.1f} s (> hang_timeout {self.hang_timeout:g} s) in {where}")
        c = self.topo.coords
        print(f"mini3d watchdog: rank {self.rank} (tp={c['tp']}, pp={c['pp']}, dp={c['dp']}) waited "
              f"{age:.1f} s in {where}; every rank dumps to {self.run_dir}; stopping the job "
              f"(run: mini3d explain-hang {self.run_dir})", file=sys.__stderr__, flush=True)
        # (to RUN_DIR/rank{r}.stderr: the launcher's report names the culprit, not this waiter)
        self._exit(HANG_EXIT, 3)

    def _exit(self, code: int, job_code: int):
        """End the process: with `code` for the local launcher to read, or under torchrun with the
        job's mini3d exit code (`job_code`) after the ranks' shared report (diagnose/torchrun.py)."""
        from . import torchrun

        if torchrun.active():
            torchrun.finish(self.run_dir, self.rank, self.topo.grid.world_size, job_code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start_watchdog(topo, run_dir: str, hang_timeout: float = 300.0, fault: str | None = None,
                   poll: float = 0.1) -> Watchdog:
    """Start this rank's watchdog; call `.finish()` when the rank's work is done."""
    return Watchdog(topo, run_dir, hang_timeout, poll, fault).start()


def keep_library_noise_in(run_dir: str, rank: int):
    """Point this process' file descriptor 2 at RUN_DIR/rank{r}.stderr, where C++ libraries write
    (gloo's abort message, c10 warnings), while Python's `sys.stderr` (progress bar, warnings, the
    launcher's report) keeps the terminal."""
    try:
        saved = os.dup(2)
        fd = os.open(os.path.join(run_dir, f"rank{rank}.stderr"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(saved, "w", buffering=1, errors="backslashreplace")


__all__ = ["Watchdog", "start_watchdog", "nccl_env", "describe_op", "RECENT_EVENTS",
           "FLIGHT_RECORDER_PREFIX"]
