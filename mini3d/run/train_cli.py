"""Pieces of `mini3d train`'s command (mini3d/cli.py): the RunConfig its flags ask for, the resume
checks (the checkpoint's model, seed, data and batch against this run's), and the one-line reports
of a failed or interrupted job.
"""

from __future__ import annotations

import os
import sys

from mini3d.config import ModelConfig, Plan


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


def run_from_args(args, cfg: ModelConfig, plan: Plan, diagnose: dict):
    """The RunConfig that `mini3d train`'s flags ask for (not validated yet: see cmd_train)."""
    from mini3d.run.config import RunConfig

    return RunConfig(model=cfg, plan=plan, steps=args.steps, lr=args.lr, seed=args.seed,
                     grad_clip=args.grad_clip, data=args.data, log_jsonl=args.log_jsonl,
                     progress=not args.no_progress, save=args.save, save_every=args.save_every,
                     init_from_hf=args.init_from_hf, **diagnose)  # mini3d.diagnose: run_dir, hang_timeout, fault, budget


def check_resume(root: str, cfg: ModelConfig, steps: int, args=None,
                 plan: Plan | None = None) -> tuple[str | None, list[str]]:
    """(checkpoint directory, problems) for --resume ROOT; with `args` and `plan`, a changed seed,
    data, global batch or tokenizer too (a warning instead with --allow-change)."""
    import dataclasses

    from mini3d.checkpoint.store import latest_dir, read_meta
    from mini3d.checkpoint.verify import shape_mismatch, verify_checkpoint

    ckpt = latest_dir(root)
    if ckpt is None:
        what = "is a file, not a checkpoint directory" if os.path.isfile(root) else \
            "holds no complete checkpoint"
        return None, [f"--resume {root!r} {what}"]
    broken = verify_checkpoint(ckpt, cfg)  # checksums, loadability, shapes: before any worker
    if broken:
        return ckpt, [f"checkpoint {ckpt!r} cannot be resumed: " + "; ".join(broken)]
    meta = read_meta(ckpt)
    out = []
    diff = shape_mismatch(meta, dataclasses.asdict(cfg))
    if diff:
        out.append(f"checkpoint {ckpt!r} is of another model shape ({'; '.join(diff)})")
    if meta["step"] >= steps:
        out.append(f"checkpoint {ckpt!r} is at step {meta['step']}, --steps={steps} asks for no more "
                   f"(--steps is the total number of steps to reach)")
    if args is not None and plan is not None:
        from mini3d.run.checks import resume_changes

        changes = resume_changes(meta, args, plan)
        if changes and not args.allow_change:
            out += [f"{c} (the resumed run would not see the batches of an uninterrupted one; "
                    f"pass --allow-change to resume anyway)" for c in changes]
        for c in changes if args.allow_change else ():
            print(f"mini3d train: warning: {c}; resuming anyway (--allow-change)", file=sys.stderr)
    return ckpt, out


__all__ = ["run_from_args", "check_resume", "report_failure", "report_interrupt",
           "checkpoint_mark", "report_twice", "stopped_while_starting"]
