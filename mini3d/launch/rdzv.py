"""A local job's private rendezvous directory, and the removal of those a killed launcher left.

Local ranks meet through a FileStore in a private (0700) directory, not a TCPStore: rank 0's
TCPStore would listen on every interface, unauthenticated, and a port picked by `free_port` can be
taken by another process before the store binds it again. The launcher removes its directory when
the job ends; a launcher killed outright (SIGKILL, the OOM killer) cannot, and its ranks die with it
(PR_SET_PDEATHSIG) before they could. So each directory records its owner (pid and start time, so a
reused pid is not mistaken for it), and every launch first removes the directories whose owner is
gone (`sweep`). The resource tracker that outlives such a launcher is kept off the terminal
(`quiet_tracker`).
"""

from __future__ import annotations

import os
import shutil
import tempfile

PREFIX = "mini3d-rdzv-"
OWNER = "owner"  # "<pid> <start time in clock ticks>" of the launcher that made the directory


def _start_time(pid: int) -> str | None:
    """The process' start time (field 22 of /proc/PID/stat), None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_alive(path: str) -> bool:
    """Is the launcher that made rendezvous directory `path` still running? (True if unknown.)"""
    try:
        with open(os.path.join(path, OWNER)) as f:
            pid, start = f.read().split()
        return _start_time(int(pid)) == start
    except FileNotFoundError:
        return True  # not made by this code (or being made right now): leave it
    except (OSError, ValueError):
        return True


def sweep(tmp: str | None = None, prefix: str = PREFIX, keep=None) -> list[str]:
    """Remove the directories `prefix*` under `tmp` (the temp dir) whose launcher is gone, except
    those `keep(path)` is true of (the default run directories use it: mini3d.diagnose.run_dir)."""
    tmp = tmp or tempfile.gettempdir()
    gone = []
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(prefix)]
    except OSError:
        return gone
    for name in names:
        path = os.path.join(tmp, name)
        if (os.path.isdir(path) and not os.path.islink(path) and not owner_alive(path)
                and not (keep and keep(path))):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def claim(path: str):
    """Record this process as the owner of directory `path` (what `sweep` checks)."""
    pid = os.getpid()
    with open(os.path.join(path, OWNER), "w") as f:
        f.write(f"{pid} {_start_time(pid)}")


def quiet_tracker():
    """Start multiprocessing's resource tracker (it tracks the job queue's semaphores) with its
    stderr on /dev/null: when its launcher is SIGKILLed it outlives it and warns of "leaked
    semaphore objects" on the terminal, noise about a process that can no longer clean up (the
    kernel frees the semaphores anyway). A tracker already running is left as it is."""
    from multiprocessing import resource_tracker

    if getattr(resource_tracker._resource_tracker, "_fd", None) is not None:
        return
    saved = os.dup(2)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        resource_tracker.ensure_running()
    except Exception:
        pass  # no tracker started here: multiprocessing starts one itself, as before
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def make() -> str:
    """A new private rendezvous directory owned by this process (after removing stale ones)."""
    quiet_tracker()
    sweep()
    path = tempfile.mkdtemp(prefix=PREFIX)
    claim(path)
    return path


__all__ = ["PREFIX", "OWNER", "make", "sweep", "claim", "owner_alive"]
