"""Ctrl-C and SIGTERM (a Slurm preemption): every rank stops at the same step boundary.

A signal sets a flag in the rank that gets it (Ctrl-C reaches every local rank; `mini3d train`
forwards a SIGTERM it receives to its ranks as SIGUSR1, keeping SIGTERM as the launcher's way to end
a rank; under torchrun the agent forwards SIGTERM/SIGINT itself). At each step boundary the ranks
take the maximum of their flags (`agree_tensor`, one one-element all-reduce over the world, read
back with the step's loss), so they all see the stop at the same step, save a checkpoint there
when --save is given, and return normally.
The exit code is 128 + the signal: 130 for SIGINT, 143 for SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal

_requested = {"signum": 0}


def _flag(signum, frame):
    _requested["signum"] = _requested["signum"] or (signal.SIGTERM if signum == signal.SIGUSR1
                                                    else signum)


def install(torchrun: bool = False):
    """In a rank's main thread: SIGINT (and SIGUSR1, or SIGTERM under torchrun) set the flag.
    A rank starts with them blocked (mini3d.launch.jobs.STOP_SIGNALS): one that came while it started
    is pending, and lands in the handler as they are unblocked here."""
    _requested["signum"] = 0
    sigs = (signal.SIGINT, signal.SIGTERM if torchrun else signal.SIGUSR1)
    for sig in sigs:
        signal.signal(sig, _flag)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)


def requested() -> int:
    return int(_requested["signum"])


def agree_tensor(device):
    """The all-reduced stop flag, not read back here: as a one-element int32 tensor
    on `device` (the trainer reads it with the step's loss, in its one host sync)."""
    import torch
    import torch.distributed as dist

    flag = torch.full((1,), requested(), dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


@contextlib.contextmanager
def launcher_signals():
    """In `mini3d train`'s process while its ranks run: the first SIGINT / SIGTERM is recorded
    (yielded list) and forwarded to the ranks; a second SIGINT raises KeyboardInterrupt."""
    from mini3d.launch.jobs import forward_stop

    got: list = []
    forward_stop(reset=True)

    def handler(signum, frame):
        if got and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not got:
            got.append(signum)
            forward_stop()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def exit_code(signum: int) -> int:
    return 128 + int(signum)


def name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


__all__ = ["install", "requested", "agree_tensor", "exit_code", "name"]
