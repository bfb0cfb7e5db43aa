"""Where local ranks are forked from: a forkserver that has already imported torch and the engine.

A spawned rank is a fresh Python that imports torch, torch._dynamo (torch.optim and meta-device
initialisation import it) and mini3d: about 3 s of CPU per process, so an 8-rank job on two
cores spent its first ~12 s importing the same modules eight times. multiprocessing's
`forkserver` start method imports them once, in one server process per launcher (started at the
first launch, kept for the launcher's life), and forks each rank from it in milliseconds. Forking
a process that has imported torch but run nothing is what DataLoader workers do every day; the
server never touches CUDA, so each rank still initialises its own device.

What `spawn` gave for free and a fork from the server must be given explicitly (mini3d.launch.boot
applies it before anything else): the launcher's *current* environment, sys.path and working
directory (the server's are those of the first launch), and the parent to die with (the server,
which dies with its launcher: mini3d.launch.server_boot, the first module it imports, arms its own
parent-death signal).
The stop signals are blocked in the server, as in a spawned rank: the launcher starts the server
inside its signal-mask window, and every rank inherits the mask from it.

Only CPU (gloo) jobs are forked so: a CUDA job's ranks are spawned, as before. A process that has
asked the CUDA driver anything (asking whether CUDA is available does, unless NVML answers) cannot hand
a working CUDA to a forked child, and what torch's imports ask is not ours to control; on a GPU
node a rank's 3 s of imports is small against the job. MINI3D_START_METHOD=spawn spawns every rank
(slower; nothing is preloaded).
"""

from __future__ import annotations

import os

START_ENV = "MINI3D_START_METHOD"
# Imported in the server before it forks: torch and everything a training rank imports. Only
# mini3d's engine, never a learner's code (exercises/, notebooks): that is imported in each rank,
# so an edit is seen at the next launch.
PRELOAD = ["mini3d.launch.server_boot", "torch", "torch._dynamo", "torch.optim", "torch.distributed",
           "torch.distributed.checkpoint", "mini3d.launch.launcher", "mini3d.run.train"]


def context(device_type: str):
    """The multiprocessing context a job's ranks start in: forkserver with PRELOAD for a CPU job,
    spawn for a CUDA job or under MINI3D_START_METHOD=spawn (see the module docstring)."""
    import torch.multiprocessing as mp

    method = os.environ.get(START_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{START_ENV}={method!r}: choose forkserver or spawn")
    if device_type != "cpu":
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # (ignored once the server runs: the same list)
    return ctx


class _Stdio:
    """The launcher's current stdout and stderr, handed to a forked rank as file descriptors (the
    server's own are those of the first launch: a test's captured output, a closed terminal)."""

    def __reduce__(self):
        from multiprocessing import reduction

        return (_inherited, (reduction.DupFd(1), reduction.DupFd(2)))  # (sent while pickling)


def _inherited(*fds) -> tuple[int, ...]:
    return tuple(fd.detach() for fd in fds)


def launch_context(ctx) -> dict:
    """What a rank forked from the server must take from its launcher now (see the module doc):
    the environment, stdout and stderr, and what multiprocessing's spawn hands a child (sys.path,
    sys.argv, working directory, and the main script, re-imported as __mp_main__ so a worker
    function defined in `python my_script.py` resolves, exactly as under spawn). Empty for a
    spawned rank, which inherits all of it."""
    from multiprocessing import spawn

    if ctx.get_start_method() != "forkserver":
        return {}
    return {"environ": dict(os.environ), "spawn": spawn.get_preparation_data("mini3d-rank"),
            "stdio": _Stdio()}


def take_context(context: dict) -> None:
    """In a rank forked from the server: become the launcher's child as spawn would have made it."""
    from multiprocessing import spawn

    for target, fd in zip((1, 2), context["stdio"]):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(context["environ"])
    spawn.prepare({k: v for k, v in context["spawn"].items() if k not in ("name", "authkey")})


def let_server_go() -> None:
    """In a forked rank: close the server's "alive" pipe that multiprocessing hands every child.

    The server exits when the last holder of that pipe's write end closes it; multiprocessing gives
    one to each child (so a child could start processes of its own through the same server). A
    rank holding it would keep the server alive after the launcher's death, and the server's
    life is what the rank's parent-death signal watches: neither would ever end. So each rank
    closes it (at once, in mini3d.launch.boot); a rank that starts processes itself then gets a
    server of its own. The attribute is multiprocessing's (private; read defensively)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def server_pid() -> int | None:
    """In a rank: the pid of the server it was forked from; None in a spawned rank."""
    import sys

    server = sys.modules.get("mini3d.launch.server_boot")  # imported in the server only
    return server.PID if server is not None and server.PID != os.getpid() else None


__all__ = ["PRELOAD", "START_ENV", "context", "launch_context", "let_server_go", "server_pid",
           "take_context"]
