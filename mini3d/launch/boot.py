"""The first code a worker runs: die with its parent, take the launcher's context, then the rest.

`mini3d.launch.launcher` starts `run(parent, context, payload, q)` rather than its worker function
directly because unpickling the worker function and its arguments may import torch (seconds, in a
spawned rank): a launcher killed in that window would leave the worker running (an orphan that
trains, and with --save writes). Here the parent-death signal is armed first, and a parent that
died before it was armed is noticed by comparing the parent pid with the one expected: the
launcher's for a spawned rank, the forkserver's for a forked one (mini3d.launch.zygote; the server
exits when its launcher does). Then the launcher's environment, sys.path and working directory
replace the server's. This module imports nothing heavy.
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


def run(parent: int, context: dict, payload: bytes, q):
    from mini3d.launch import zygote  # (imports only os)

    server = zygote.server_pid()
    die_with_parent(server or parent)
    if server is not None:  # forked from the server: the launcher's environment, stdio, path, main
        zygote.let_server_go()  # so that the server, and with it this rank, ends with the launcher
        zygote.take_context(context)
    import pickle

    # The payload starts with mini3d.launch.launcher's worker function: unpickling it imports mini3d.launch.launcher
    # (and torch) only now, and keeps this module free of imports back into the launcher.
    worker, *args = pickle.loads(payload)
    worker(*args[:8], q, *args[8:])
