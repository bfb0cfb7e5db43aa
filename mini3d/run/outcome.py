"""How a launched `mini3d train` job ended, said in one line first: a rank's failure (the
culprit named by mini3d.diagnose.report, else the launcher's exception), an error that carries its
own exit code and message (`mini3d.exits.Mini3dError`: a non-finite loss, out of memory), a stop
by a signal (at a step boundary, or a second Ctrl-C), and the exit code that goes with each.
"""

from __future__ import annotations

import os
import sys

from mini3d.exits import EXIT_FAILED


def report_worker_error(exc, got: list, run_dir: str | None) -> int:
    """The exit code of a job a rank ended (`exc`, a launcher WorkerError), its story printed: a
    stop while the ranks started, an error with its own exit code (its message is the story),
    else the failure report."""
    code = stopped_while_starting(exc, got)
    if code is not None:
        return code
    if exc.exit_code != EXIT_FAILED:
        print(f"mini3d train: {exc.text}", file=sys.stderr)
        return exc.exit_code
    return report_failure(exc, run_dir, EXIT_FAILED)


def report_interrupt(stopped: dict, got: list, save: str | None) -> int:
    """One line for a job stopped by a signal; 130 (SIGINT) or 143 (SIGTERM)."""
    from mini3d.run.stop import exit_code, name

    signum = got[0]
    where = f"; checkpoint {save}/step-{stopped['step']:06d} saved" if stopped["saved"] else ""
    print(f"mini3d train: stopped by {name(signum)} after step {stopped['step']}{where}",
          file=sys.stderr, flush=True)
    return exit_code(signum)


def checkpoint_mark(save: str | None):
    """(latest complete checkpoint under --save, its meta.json's mtime), to tell afterwards
    whether this run wrote one; None without --save or a checkpoint."""
    from mini3d.checkpoint.store import latest_dir

    ckpt = latest_dir(save) if save else None
    return (ckpt, os.path.getmtime(os.path.join(ckpt, "meta.json"))) if ckpt else None


def report_twice(save: str | None, before) -> int:
    """A second Ctrl-C stopped every rank at once: say which checkpoint is the last complete one
    (one may have been committed between the two), or that there is none."""
    now = checkpoint_mark(save)
    if now is None:
        where = " without a checkpoint"
    elif now == before:
        where = f" before this run wrote a checkpoint (the last complete one, {now[0]}, is older)"
    else:
        where = f"; the last complete checkpoint is {now[0]}"
    print(f"mini3d train: interrupted twice: every rank was stopped{where}", file=sys.stderr)
    return 130


def stopped_while_starting(exc, got: list) -> int | None:
    """The exit code (130 / 143) when the launcher was asked to stop and a rank ended of that
    stop before it could act on it (killed by the signal, or a KeyboardInterrupt); else None:
    the launcher's stop, not a rank, ends such a job, so no rank is blamed."""
    import signal

    from mini3d.run.stop import exit_code, name

    died = {f"process exited with code -{int(s)} " for s in (signal.SIGINT, signal.SIGUSR1,
                                                             signal.SIGTERM)}
    if not got or not (exc.message.startswith("KeyboardInterrupt")
                       or any(exc.message.startswith(d) for d in died)):
        return None
    print(f"mini3d train: stopped by {name(got[0])} while the ranks were starting (no step was "
          f"taken, no checkpoint written)", file=sys.stderr, flush=True)
    return exit_code(got[0])


def report_failure(exc: Exception, run_dir: str | None, code: int) -> int:
    """Print the failure culprit first (mini3d.diagnose.report), else the launcher's exception."""
    from mini3d.diagnose.report import failure_report

    lines = failure_report(run_dir)
    if lines is None:
        lines = [str(exc)] + ([f"(per-rank state: mini3d explain-hang {run_dir})"] if run_dir else [])
    print("mini3d train: " + "\n".join(lines), file=sys.stderr, flush=True)
    return code


__all__ = ["report_worker_error", "report_failure", "report_interrupt", "checkpoint_mark",
           "report_twice", "stopped_while_starting"]
