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
its Python stack in `rank{r}.stack`, and its black box (diagnose/blackbox.py) the ops it issued. `mini3d explain-hang RUN_DIR` reads all of these.

PyTorch's own flight recorder (NCCL's; gloo's too in recent torch) and NCCL's timeouts are
configured by `nccl_env` (diagnose/flight_recorder.py), the one place that sets those variables;
the process group's own timeout follows `hang_timeout` too (`PG_TIMEOUT_ENV`, read by
mini3d.launch.launcher), a minute later, so that the mini3d dump comes first on every backend. Because the
ranks exit before torch's timeout would dump the recorder, each rank asks torch for it on its way out
(`write_dump`: RUN_DIR/nccl_trace_rank_<r>, read by explain-hang too). A checkpoint save runs on its
own clock, not the hang clock (`saving`, diagnose/save_clock.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time

from mini3d.diagnose.blackbox import BlackBox
from mini3d.diagnose.flight_recorder import FLIGHT_RECORDER_PREFIX, nccl_env, recorder_path, write_dump
from mini3d.diagnose.history import describe_op
from mini3d.diagnose.save_clock import SaveClock, save_bound
from mini3d.launch.launcher import ABORTED_EXIT, HANG_EXIT, abort_marker, on_failure

RECENT_EVENTS = 256  # events per dump: enough to align sequence numbers across a group


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
        self.save: SaveClock | None = None  # the checkpoint save in progress (see `saving`)

    @property
    def marker(self) -> str:
        return abort_marker(self.run_dir)  # this job's (MINI3D_JOB_ID): never another job's

    def start(self) -> "Watchdog":
        os.makedirs(self.run_dir, exist_ok=True)
        keep_library_noise_in(self.run_dir, self.rank)  # gloo's abort text: not the first line
        self._stack_file = open(os.path.join(self.run_dir, f"rank{self.rank}.stack"), "w")
        faulthandler.enable(file=self._stack_file, all_threads=True)  # SIGABRT/SIGSEGV stacks
        self.topo.log.on_issue = BlackBox(self.run_dir, self.rank)  # survives a library abort
        on_failure(self._on_error)
        self._thread.start()
        return self

    def finish(self):
        """The rank's function returned: stop watching and record a "finished" dump."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        self.dump("finished", "the rank's function returned")
        box, self.topo.log.on_issue = self.topo.log.on_issue, None
        if isinstance(box, BlackBox):
            box.close()
        faulthandler.disable()
        if self._stack_file is not None:
            self._stack_file.close()
            path = self._stack_file.name
            if os.path.exists(path) and os.path.getsize(path) == 0:
                os.remove(path)

    @contextlib.contextmanager
    def saving(self, nbytes: int, step: int):
        """While inside, the ops this rank issues run on the save's clock, not the hang clock
        (mini3d.diagnose.save_clock)."""
        grid = self.topo.grid
        writers = tuple(range(grid.world_size))  # every rank writes its share (sharded DCP saves)
        self.save = SaveClock(time.perf_counter(), save_bound(nbytes, self.hang_timeout), nbytes,
                              step, writers)
        try:
            yield self.save
        finally:
            self.save = None

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
            "coords": self.topo.coords, "grid": {**grid.sizes, "ep": grid.ep, "order": "-".join(grid.order),
                                                 "world_size": grid.world_size},
            "context": dict(log.context), "hang_timeout": self.hang_timeout, "fault": self.fault,
            "blocked": _event_dict(blocked, now, blocked) if blocked else None,
            "pending": [_event_dict(e, now, blocked) for e in pending],
            "events": [_event_dict(e, now, blocked) for e in recent],
            "seq": log.seq_counts(), "time": time.time(),
            "save": self.save.as_dict(now) if self.save else None,
            "flight_recorder": recorder_path(),  # where torch's own dump on a timeout goes
            **(extra or {}),
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
            ev, save, now = self.blocked_event(), self.save, time.perf_counter()
            if save is not None and (ev is None or ev.start >= save.start):  # on the save's clock
                if save.overdue(now, waiting=ev is not None):
                    self._stuck_save(save, ev, now)
            elif ev is not None and now - ev.start > self.hang_timeout:
                self._hang(ev)

    def _abort(self):
        try:
            with open(self.marker) as f:
                why = json.load(f)
        except (OSError, ValueError):
            why = {}
        self.dump("aborted", f"job aborted by {why.get('by', 'another rank')}: {why.get('reason', '')}")
        self._exit(ABORTED_EXIT, int(why.get("code", 1)) if isinstance(why, dict) else 1)

    def _claim(self, reason: str) -> bool:
        """Create the job's abort marker; False when another rank saw trouble first."""
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # another rank saw it first: we are one of the waiters
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"by": self.rank, "reason": reason, "code": 3}, f)
        return True

    def _hang(self, ev):
        where = describe_op(ev.as_dict())
        if not self._claim(f"rank {self.rank} hung in {where}"):
            return self._abort()
        age = time.perf_counter() - ev.start
        self.dump("hang", f"waited {age:.1f} s (> hang_timeout {self.hang_timeout:g} s) in {where}")
        self._stop_job(f"waited {age:.1f} s in {where}")

    def _stuck_save(self, save: SaveClock, ev, now: float):
        """The save ran past its bound: this rank's own part of it (no op pending), or the wait
        in one of its barriers for the writers (reported `waiter_grace` later)."""
        if ev is None:
            status, reason = "stuck-save", save.describe(self.rank, now)
        else:
            status = "hang"
            reason = (f"waited {now - ev.start:.1f} s in {describe_op(ev.as_dict())} for the "
                      f"checkpoint save's writers (ranks {', '.join(map(str, save.writers))}), "
                      f"past the save's bound of {save.bound:.0f} s")
        if not self._claim(reason):
            return self._abort()
        self.dump(status, reason)
        self._stop_job(reason.replace(f"rank {self.rank}'s", "its"))

    def _stop_job(self, what: str):
        from mini3d.diagnose.run_dir import coords_text

        where = coords_text(self.topo.coords, {**self.topo.grid.sizes, "ep": self.topo.grid.ep})
        print(f"mini3d watchdog: rank {self.rank} ({where}) {what}; "
              f"every rank dumps to {self.run_dir}; stopping the job (run: mini3d explain-hang "
              f"{self.run_dir})", file=sys.__stderr__, flush=True)
        # (to RUN_DIR/rank{r}.stderr: the launcher's report names the culprit, not this waiter)
        self._exit(HANG_EXIT, 3)

    def _exit(self, code: int, job_code: int):
        """End the process: with `code` for the local launcher to read, or under torchrun with the
        job's mini3d exit code (`job_code`) after the ranks' shared report (diagnose/torchrun.py)."""
        from mini3d.diagnose import torchrun

        write_dump(self.run_dir, self.rank)  # torch's flight recorder, before the process ends
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
