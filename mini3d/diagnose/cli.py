"""`mini3d explain-hang DIR`: explain a hang or failure from the per-rank dumps in DIR."""

from __future__ import annotations

import os

from mini3d.diagnose.p2p_order import register as register_p2p_judge
from mini3d.exits import bad_input

register_p2p_judge()  # the full p2p check judges every job `mini3d train` launches


def cmd_explain_hang(args) -> int:
    from mini3d.diagnose.explain import explain

    if not os.path.isdir(args.dir):
        return bad_input([f"DIR={args.dir!r} is not a directory"], "explain-hang", after="")
    try:
        result = explain(args.dir)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:  # a damaged dump
        return bad_input([f"{_damaged(_chosen(args.dir), e)} (a dump cut short or edited?)"], "explain-hang",
                         after="")
    if result is None:
        from mini3d.diagnose.flight_recorder import summary_lines

        nccl = summary_lines(args.dir)  # a job killed before mini3d dumped may still have these
        if nccl:
            print("\n".join(nccl))
            return 0
        return bad_input([f"DIR={args.dir!r} holds no rank*.json dumps (pass the --run-dir of the "
                          f"failed job)"], "explain-hang", after="")
    print("".join(_job_lines(args.dir)) + result.text)
    return 0


def _chosen(run_dir: str) -> str:
    from mini3d.diagnose.run_dir import pick_job

    return pick_job(run_dir)[0]


def _job_lines(run_dir: str) -> list[str]:
    """The jobs of a shared run directory, oldest first, the explained one marked (each job has its
    own RUN_DIR/job-<id>; `mini3d explain-hang RUN_DIR/job-<id>` explains another)."""
    from mini3d.diagnose.run_dir import pick_job

    run_dir = run_dir.rstrip("/") or run_dir
    chosen, found = pick_job(run_dir)
    if not found:
        return []
    lines = [f"{len(found)} job(s) in {run_dir}, oldest first (explain another with mini3d "
             f"explain-hang {run_dir}/job-<id>):"]
    lines += [f"  {os.path.basename(p)}: {outcome}" + ("   <- explained below" if p == chosen else "")
              for p, outcome in found]
    return [line + "\n" for line in lines]


def _damaged(run_dir: str, error: Exception) -> str:
    """The first dump of `run_dir` that is not a JSON object with a rank, named with its error;
    else `run_dir` with `error`."""
    import glob
    import json

    why = f"{type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}"
    for path in sorted(glob.glob(os.path.join(run_dir, "*.json"))):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            return f"{path} is damaged ({str(e).splitlines()[0][:80]})"
        if os.path.basename(path).startswith("rank") and not (isinstance(d, dict) and "rank" in d):
            return f"{path} is damaged (not a rank dump: no 'rank' field)"
    return f"DIR={run_dir!r} holds a dump explain-hang cannot read ({why})"


def diagnose_problems(args, plan) -> list[str]:
    """Bad values among the diagnostics flags (mini3d.diagnose)."""
    from mini3d.diagnose.faults import fault_problems, parse_fault, parse_size

    out = []
    if args.hang_timeout <= 0:
        out.append(f"hang_timeout={args.hang_timeout} must be > 0 seconds")
    for flag, value, parse in (("--inject-fault", args.inject_fault, parse_fault),
                               ("--memory-budget", args.memory_budget, parse_size)):
        if value is None:
            continue
        try:
            parsed = parse(value)
        except ValueError as e:
            out.append(str(e))
            continue
        if flag == "--inject-fault":
            out += fault_problems(parsed, plan, args.steps)
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        out.append(f"gpus_per_node={args.gpus_per_node} must be >= 1")
    return out


def make_run_dir(spec):
    """`spec` with a run dir: its own, else a new temp dir (made only for a run that starts, after
    removing those a killed launcher left: mini3d.diagnose.run_dir.make_default)."""
    from mini3d.diagnose.run_dir import make_default

    return spec if spec.run_dir else spec.replace(run_dir=make_default())


def add_train_args(p):
    """The diagnostics flags of `mini3d train` that are not RunConfig fields (--hang-timeout,
    --run-dir, --inject-fault and --memory-budget are: mini3d.run.flags makes them)."""
    d = p.add_argument_group("diagnostics (mini3d.diagnose)")
    d.add_argument("--dry-run", action="store_true",
                   help="validate, print the rank map, prove the step deadlock-free; start nothing")
    d.add_argument("--gpus-per-node", type=int, help="flag node boundaries in the dry-run map")


def register(subparsers):
    p = subparsers.add_parser("explain-hang", help="explain a hang from the per-rank dumps",
                              description="Merge the rank*.json dumps that the hang watchdog wrote "
                                          "and say which rank, axis, micro-batch and op went wrong.")
    p.add_argument("dir", metavar="DIR", help="the run directory (mini3d train --run-dir)")
    p.set_defaults(func=cmd_explain_hang)


__all__ = ["register", "cmd_explain_hang", "add_train_args", "diagnose_problems", "make_run_dir"]
