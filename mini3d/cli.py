"""`mini3d train | prepare | sample | estimate | plan | calibrate | schedule | explain-hang | import-hf | export-hf | grade`.

Exit codes (a contract, see docs/ARCHITECTURE.md and mini3d/exits.py): 0 success; 1 a rank failed;
2 bad input, reported before any process starts with a message naming the offending values; 3 the
job timed out or hung (see `mini3d explain-hang`); 4 out of memory (the report names rank, stage,
category and plans that fit); 5 a non-finite loss; 130 / 143 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mini3d.config import PlanError
from mini3d.exits import EXIT_HUNG, EXIT_OK, bad_input
from mini3d.run.config import RunConfig
from mini3d.run.flags import (add_model_flags, add_plan_flags, add_run_flags, configs_from_args,
                              run_fields)
from mini3d.run.checks import check_resume
from mini3d.run.outcome import (checkpoint_mark, report_failure, report_interrupt, report_twice,
                                report_worker_error)

# Subcommands that live next to the code they drive; each module exposes register(subparsers).
SUBCOMMAND_MODULES = ("mini3d.run.cost_cli", "mini3d.run.schedule_cli", "mini3d.diagnose.cli", "mini3d.data.prepare",
                      "mini3d.run.sample", "mini3d.checkpoint.hf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mini3d", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a GPT with tp x pp x dp processes",
                       description="Train on the embedded corpus (or --data). Run plainly it spawns "
                                   "tp*cp*pp*dp local processes; under torchrun it uses the environment.")
    add_model_flags(t)
    add_plan_flags(t)
    add_run_flags(t)  # every RunConfig field: steps, optimizer, data, logging, saves, diagnostics
    r = t.add_argument_group("launch")
    r.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    r.add_argument("--world-size", type=int, help="number of processes (default tp*cp*pp*dp)")
    r.add_argument("--timeout", type=float, default=3600, help="seconds before the job is stopped")
    r.add_argument("--allow-change", action="store_true",
                   help="resume although --seed, --data or --global-batch differ from the checkpoint's")
    from mini3d.diagnose.cli import add_train_args

    add_train_args(t)  # mini3d.diagnose: --dry-run --gpus-per-node
    t.set_defaults(func=cmd_train)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    add_grade_command(sub)
    return parser


def add_grade_command(sub):
    """`mini3d grade` is the course's (mini3d.course.grading.cli): the words after `grade` are handed
    to its own parser, so the engine imports nothing of the course until someone grades."""
    g = sub.add_parser("grade", help="grade the exercises (or the reference solutions)",
                       add_help=False, prefix_chars="\0")  # no option of ours: every word goes on
    g.add_argument("words", nargs=argparse.REMAINDER)
    g.set_defaults(func=lambda args: importlib.import_module("mini3d.course.grading.cli").main(args.words))


def validated_train(args):
    """Everything `mini3d train` checks before a process starts: the RunConfig it will run, or the
    exit code (2 for bad input naming every value; a dry run's verdict).

    Returns (spec, plan, world, torchrun, derived run dir) or an int."""
    from mini3d.launch.launcher import LaunchError, choose_device, in_torchrun, worker_threads

    from mini3d.run.model_source import run_model

    try:  # a checkpoint (--resume) or an HF directory (--init-from-hf) is the model; else the flags
        cfg, fixed, problems = run_model(args, lambda: configs_from_args(args)[0])
    except PlanError as e:
        return bad_input(e.problems)
    if cfg is None:
        return bad_input(problems)
    plan = configs_from_args(args)[1]
    torchrun = in_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (args.world_size or plan.world_size)
    from mini3d.diagnose.cli import diagnose_problems
    from mini3d.run.options import run_options

    derived, shared = False, []
    if torchrun:  # one run directory for all ranks: --run-dir, or derived from the rendezvous id
        from mini3d.diagnose.torchrun import run_dir_for

        run_dir, problem = run_dir_for(args.run_dir)
        shared = [problem] if problem else []
        derived, args.run_dir = not args.run_dir, run_dir or args.run_dir
    from mini3d.run.checks import run_problems

    early = problems + run_problems(args, plan, cfg) + shared  # before make_run_dir makes a run dir
    cfg, tokenizer, problems = run_options(args, cfg, fixed)  # the tokenizer decides the vocabulary
    spec = RunConfig(model=cfg, plan=plan, **{**run_fields(args), "tokenizer": tokenizer})
    problems = spec.problems(world) + problems + early
    problems += diagnose_problems(args, plan)  # mini3d.diagnose: fault, budget and timeout flags
    if args.resume:  # (before the dry run: its verdict covers the checkpoint too)
        resume, resume_problems = check_resume(args.resume, cfg, args.steps, args, plan)
        problems += resume_problems
        spec = spec.replace(resume=resume)
    if args.dry_run:  # validate, map, the recorded step's comm verdict, memory; starts nothing
        from mini3d.run.dryrun import dry_run

        return bad_input(problems) if problems else dry_run(cfg, plan, args.gpus_per_node,
                                                            grad_clip=args.grad_clip)
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else world
        worker_threads(choose_device(args.device, local, per_process=torchrun)[1], local)  # $MINI3D_THREADS
    except LaunchError as e:
        problems.append(str(e))
    if problems:
        return bad_input(problems)
    from mini3d.diagnose.cli import make_run_dir

    return make_run_dir(spec), plan, world, torchrun, derived


def cmd_train(args) -> int:
    from mini3d.launch.launcher import LaunchTimeout, WorkerError

    job = validated_train(args)
    if isinstance(job, int):
        return job
    spec, plan, world, torchrun, derived = job
    from mini3d.run.train import summary_line

    spec = spec.replace(stop_on_signal=True)  # Ctrl-C / SIGTERM: stop at a step boundary
    if torchrun:  # the local launcher's failure handling, among the ranks (mini3d.diagnose)
        from mini3d.run import torchrun as under_torchrun

        return under_torchrun.train(spec, args.device, derived)
    from mini3d.launch.jobs import job_dir, new_job
    from mini3d.run.stop import launcher_signals

    root, job = spec.run_dir, new_job()  # this job's own RUN_DIR/job-<id>: never another job's
    spec = spec.replace(run_dir=job_dir(root, job))
    before, got = checkpoint_mark(args.save), []
    try:
        with launcher_signals() as got:
            results = launch_train(spec, world, args.device, args.timeout, job)
    except KeyboardInterrupt:  # a second Ctrl-C: the ranks were stopped at once
        return report_twice(args.save, before)
    except WorkerError as e:  # a rank's error, with its class's exit code (mini3d.exits)
        return report_worker_error(e, got, spec.run_dir)
    except LaunchTimeout as e:
        return report_failure(e, spec.run_dir, EXIT_HUNG)
    finally:  # reported (or about to go): a default run directory is not a killed launcher's
        if not args.run_dir:
            from mini3d.diagnose.run_dir import release

            release(root)
    if not args.run_dir:  # the default (temporary) run directory served its purpose (no failure)
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    stopped = next((r["interrupted"] for r in results if r.get("interrupted")), None)
    if stopped:
        return report_interrupt(stopped, got or [stopped["signal"]], args.save)
    reporter = next(r for r in results if r["reporter"])
    print(summary_line(reporter["records"], plan, reporter["device"]), flush=True)
    return EXIT_OK


def launch_train(spec, world: int, device: str = "auto", timeout: float = 3600,
                 job: str | None = None):
    """Spawn `world` local processes running `train_worker(spec)` (a RunConfig)."""
    from mini3d.diagnose.save_clock import checkpoint_bytes
    from mini3d.diagnose.watchdog import nccl_env
    from mini3d.launch.launcher import choose_device, launch
    from mini3d.run.train import train_worker

    run_dir = spec.run_dir
    backend = choose_device(device, world)[0]
    save_bytes = checkpoint_bytes(spec.model.n_params()) if spec.save else 0  # its barriers' timeout
    env = nccl_env(spec.hang_timeout, run_dir, backend, save_bytes) if run_dir else None
    return launch(train_worker, world, spec, device=device, timeout=timeout, run_dir=run_dir, env=env,
                  job=job)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
