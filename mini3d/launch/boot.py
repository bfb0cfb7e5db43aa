"""The first code a spawned worker runs: die with the launcher, then import the rest.

`mini3d.launch.launcher` spawns `run(parent, payload, q)` rather than its worker function directly because
unpickling the worker function and its arguments imports torch (seconds): a launcher killed in
that window would leave the worker running (an orphan that trains, and with --save writes). Here
the parent-death signal is armed first, and a launcher that died before it was armed is noticed by
comparing the parent pid with the launcher's. This module imports nothing heavy.
"""

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None):
    """Ask Linux to SIGKILL this process when its parent dies; exit now if it already has."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the launcher died before the signal was armed: nobody will collect us


def run(parent: int, payload: bytes, q):
    die_with_parent(parent)
    import pickle

    # The payload starts with mini3d.launch.launcher's worker function: unpickling it imports mini3d.launch.launcher
    # (and torch) only now, and keeps this module free of imports back into the launcher.
    worker, *args = pickle.loads(payload)
    worker(*args[:8], q, *args[8:])
