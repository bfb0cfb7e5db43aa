"""What a local job reports when it fails, shared by the launcher, the watchdogs and torchrun's
path: the exit statuses of a rank's watchdog, the job's own abort marker, and the exceptions
`launch` raises (a rank failed, the job timed out, a watchdog saw a hang); and the launcher's live
ranks, to which it forwards a stop.
"""

from __future__ import annotations

import os
import signal

from mini3d.exits import EXIT_FAILED

HANG_EXIT = 86  # exit status of a rank whose hang watchdog (mini3d.diagnose.watchdog) saw a hang
ABORTED_EXIT = 87  # exit status of a rank whose watchdog dumped because another rank failed
ABORT_MARKER = "ABORT"  # file in the run directory that tells every rank's watchdog to dump and exit
JOB_ENV = "MINI3D_JOB_ID"  # this job's id: its abort marker is ABORT-<id> (see abort_marker)


class WorkerError(RuntimeError):
    """A rank raised or died; carries its rank, traceback, and the exit code of what it raised
    (`mini3d.exits.exit_code_of`, with `text`, the exception's own message)."""

    def __init__(self, rank: int, message: str, tb: str = "", exit_code: int = EXIT_FAILED,
                 text: str | None = None):
        self.rank, self.message, self.traceback = rank, message, tb
        self.exit_code, self.text = exit_code, message if text is None else text
        text = f"rank {rank} failed: {message}"
        if tb:
            text += f"\n--- traceback from rank {rank} ---\n{tb.rstrip()}"
        super().__init__(text)


class LaunchTimeout(TimeoutError):
    """The job did not finish in time; `pending` lists the ranks that had not returned."""

    def __init__(self, timeout: float, pending: list[int]):
        self.pending = pending
        super().__init__(f"job did not finish within {timeout:.0f} s; ranks still running: {pending} "
                         f"(all processes were stopped)")


class HangDetected(LaunchTimeout):
    """A rank's watchdog saw an op pending past the hang timeout; every rank dumped to `run_dir`."""

    def __init__(self, rank: int, run_dir: str | None):
        self.rank, self.run_dir, self.pending = rank, run_dir, [rank]
        TimeoutError.__init__(self, f"hang detected by rank {rank}'s watchdog; every rank dumped its "
                                    f"communication state to {run_dir} (all processes were stopped); "
                                    f"run: mini3d explain-hang {run_dir}")


def abort_marker(run_dir: str, job: str | None = None) -> str:
    """RUN_DIR/ABORT-<job id>: one marker per job, so that neither a stale marker left by a failed
    job nor another job sharing the run directory can stop this one."""
    job = job or os.environ.get(JOB_ENV)
    return os.path.join(run_dir, f"{ABORT_MARKER}-{job}" if job else ABORT_MARKER)


JOB_PREFIX = "job-"  # a job's own directory inside a shared run directory: RUN_DIR/job-<id>


def new_job() -> str:
    """A job id that sorts by start time (UTC, to the microsecond: two jobs started in the same
    second, as a quick failure and its rerun are, still sort oldest first) and is unique:
    20261202-021530.048213-3fa9c1."""
    import datetime
    import uuid

    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y%m%d-%H%M%S.%f") + "-" + uuid.uuid4().hex[:6]


def job_dir(run_dir: str, job: str) -> str:
    """RUN_DIR/job-<id>, made if missing: where one job's ranks dump and its launcher records, so
    that a later job sharing RUN_DIR never clears or mixes with an earlier job's post-mortem."""
    path = os.path.join(run_dir, JOB_PREFIX + job)
    os.makedirs(path, exist_ok=True)
    return path


def _clear_run_dir(run_dir: str):
    """Remove a previous job's marker and dumps, so that they cannot abort or confuse this one."""
    os.makedirs(run_dir, exist_ok=True)
    for name in os.listdir(run_dir):
        if name in (ABORT_MARKER, "launcher.json") or (
                name.startswith("rank") and name.endswith((".json", ".stack", ".stderr"))):
            os.remove(os.path.join(run_dir, name))


_CHILDREN: set = set()  # the live worker processes of this launcher (for forward_stop)
# Blocked in a rank from its start (fork and exec inherit the mask) until mini3d.run.stop.install
# unblocks them: a stop while the ranks start reaches the handler, not the default action (death).
STOP_SIGNALS = (signal.SIGINT, signal.SIGUSR1)
_ASKED = {"stop": False}  # forward_stop was called: `launch` repeats it to ranks started since


def forward_stop(reset: bool = False):
    """Ask every live local rank to stop at its next step boundary (SIGUSR1: see mini3d.run.stop),
    and remember it for ranks still being started (`reset`: forget it, for a new job)."""
    _ASKED["stop"] = not reset
    for p in list(_CHILDREN) if not reset else ():
        if p.pid is not None and p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass


__all__ = ["JOB_PREFIX", "new_job", "job_dir", "HANG_EXIT", "ABORTED_EXIT", "ABORT_MARKER", "JOB_ENV", "WorkerError", "LaunchTimeout",
           "HangDetected", "abort_marker", "STOP_SIGNALS", "forward_stop"]
