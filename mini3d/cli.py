"""`mini3d train | estimate | plan | calibrate | schedule | explain-hang | grade`.

Exit codes (a contract, see docs/ARCHITECTURE.md): 0 success; 2 bad input, reported before any process starts
with a message naming the offending values; 1 a rank failed; 3 the job timed out or hung (see
`mini3d explain-hang`); 4 out of memory (the report names rank, stage, category and plans that fit).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .config import PRESETS, ModelConfig, Plan, PlanError, model_from_preset
from mini3d.run.model_args import add_family_args, family_overrides

from .exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_HUNG, EXIT_OK, EXIT_OOM, bad_input  # noqa: F401
from .exits import EXIT_NONFINITE
from mini3d.run.train_cli import (check_resume, checkpoint_mark, report_failure, report_interrupt,
                                  report_twice, run_from_args, stopped_while_starting)

# Subcommands that live next to the code they drive; each module exposes register(subparsers).
SUBCOMMAND_MODULES = ("mini3d.run.cost_cli", "mini3d.pp.cli", "mini3d.diagnose.cli", "mini3d.data.prepare",
                      "mini3d.run.sample", "mini3d.checkpoint.hf")


def add_model_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("model (a preset, optionally with fields overridden)")
    g.add_argument("--model", help=f"preset (default tiny): {', '.join(PRESETS)}")
    g.add_argument("--layers", type=int, help="number of transformer blocks")
    g.add_argument("--hidden", type=int, help="hidden size d_model")
    g.add_argument("--heads", type=int, help="attention heads")
    g.add_argument("--vocab", type=int, help="vocabulary size")
    g.add_argument("--ffn", type=int, help="MLP width (default 4 x hidden)")
    add_family_args(g)


def model_from_args(args) -> ModelConfig:
    preset = args.model or "tiny"
    over = {k: v for k, v in (("n_layers", args.layers), ("d_model", args.hidden),
                              ("n_heads", args.heads), ("vocab_size", args.vocab),
                              ("d_ff", args.ffn)) if v is not None}
    over.update(family_overrides(args))
    if "n_heads" in over and "n_kv_heads" not in over and PRESETS.get(preset) and \
            PRESETS[preset].n_kv_heads == PRESETS[preset].n_heads:
        over["n_kv_heads"] = 0  # still one key/value head per query head
    if "d_model" in over and "d_ff" not in over:
        over["d_ff"] = 4 * over["d_model"]
    if over:
        over["name"] = f"{preset}+custom"
    return model_from_preset(preset, **over)


def add_plan_args(p: argparse.ArgumentParser, seq_len_default: int = 64, global_batch_default: int = 8):
    g = p.add_argument_group("parallel plan")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    g.add_argument("--cp", type=int, default=1, help="context-parallel degree (ring attention over "
                                                    "2*cp zig-zag chunks of each sequence)")
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    g.add_argument("--schedule", default="1f1b",
                   help="gpipe, 1f1b, interleaved, looped-bfs, zb-h1 or zbv (zbv: --virtual-stages 2)")
    g.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank")
    g.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step per replica")
    g.add_argument("--global-batch", type=int, default=global_batch_default, help="sequences per step")
    g.add_argument("--seq-len", type=int, default=seq_len_default, help="tokens per sequence")
    g.add_argument("--recompute", default="none", help="none, selective or full")
    g.add_argument("--dtype", default="float32",
                   help="float32, bf16 (fp32 master weights) or float64 (exact parity checks)")
    g.add_argument("--sequence-parallel", action="store_true", help="shard LayerNorm regions (tp > 1)")
    g.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket size in MiB")
    g.add_argument("--grad-dtype", default="float32",
                   help="bf16 runs: accumulate and reduce gradients in float32 (default) or bf16 "
                        "(half the gradient memory and dp traffic, rounded at every sum)")
    g.add_argument("--attention", default="explicit",
                   help="explicit (written out, keeps the s x s matrix: what the course measures) "
                        "or sdpa (torch's fused scaled_dot_product_attention: for real runs)")
    g.add_argument("--compile", nargs="?", const="inductor", default="none", metavar="BACKEND",
                   help="torch.compile each transformer block (regional compilation; the collectives "
                        "stay eager): --compile alone is inductor; aot_eager traces without codegen")


def plan_from_args(args) -> Plan:
    return Plan(tp=args.tp, pp=args.pp, dp=args.dp, zero=args.zero, schedule=args.schedule,
                micro_batches=args.micro_batches, virtual_stages=args.virtual_stages,
                recompute=args.recompute, dtype=args.dtype, global_batch=args.global_batch,
                seq_len=args.seq_len, sequence_parallel=args.sequence_parallel,
                bucket_mb=args.bucket_mb, attention=args.attention, grad_dtype=args.grad_dtype,
                cp=args.cp, compile=args.compile)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mini3d", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a GPT with tp x pp x dp processes",
                       description="Train on the embedded corpus (or --data). Run plainly it spawns "
                                   "tp*cp*pp*dp local processes; under torchrun it uses the environment.")
    add_model_args(t)
    add_plan_args(t)
    r = t.add_argument_group("run")
    r.add_argument("--steps", type=int, default=20)
    r.add_argument("--lr", type=float, default=3e-3)
    r.add_argument("--grad-clip", type=float, default=0.0, metavar="NORM",
                   help="clip the global gradient norm to NORM (0: off; 1.0 is usual)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--data", help="a text file, or a `mini3d prepare` shard directory (default: the "
                                  "embedded corpus)")
    r.add_argument("--device", default="auto", help="auto, cpu or cuda")
    r.add_argument("--log-jsonl", metavar="FILE", help="one JSON object per optimizer step")
    r.add_argument("--save", metavar="DIR", help="write checkpoints under DIR (at the end, and "
                                                   "every --save-every steps)")
    r.add_argument("--save-every", type=int, default=0, metavar="N", help="also save every N steps")
    r.add_argument("--resume", metavar="DIR", help="continue from the latest checkpoint under DIR "
                   "(any layout; it is the model: no model flag needed); --steps is the total to reach")
    r.add_argument("--init-from-hf", metavar="HF_DIR", help="start from a local Hugging Face GPT-2 / "
                   "Llama directory (its config.json is the model: no model flag needed; see mini3d import-hf)")
    r.add_argument("--world-size", type=int, help="number of processes (default tp*cp*pp*dp)")
    r.add_argument("--timeout", type=float, default=3600, help="seconds before the job is stopped")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--allow-change", action="store_true",
                   help="resume although --seed, --data or --global-batch differ from the checkpoint's")
    from .diagnose.cli import add_train_args
    from mini3d.run.options import add_run_args

    add_run_args(t)  # tokenizer, validation, lr schedule, metrics, long runs
    add_train_args(t)  # mini3d.diagnose: --hang-timeout --run-dir --inject-fault --memory-budget ...
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
    from mini3d.launch.launcher import LaunchError, choose_device, in_torchrun

    from mini3d.run.model_source import run_model

    try:  # a checkpoint (--resume) or an HF directory (--init-from-hf) is the model; else the flags
        cfg, fixed, problems = run_model(args, lambda: model_from_args(args))
    except PlanError as e:
        return bad_input(e.problems)
    if cfg is None:
        return bad_input(problems)
    plan = plan_from_args(args)
    torchrun = in_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (args.world_size or plan.world_size)
    from .diagnose.cli import diagnose_problems, diagnose_spec

    from mini3d.run.options import run_options

    derived, shared = False, []
    if torchrun:  # one run directory for all ranks: --run-dir, or derived from the rendezvous id
        from .diagnose.torchrun import run_dir_for

        run_dir, problem = run_dir_for(args.run_dir)
        shared = [problem] if problem else []
        derived, args.run_dir = not args.run_dir, run_dir or args.run_dir
    from mini3d.run.checks import run_problems

    early = problems + run_problems(args, plan, cfg) + shared  # before diagnose_spec makes a run dir
    cfg, options, problems = run_options(args, cfg, fixed)  # tokenizer, eval, schedule, metrics
    spec = run_from_args(args, cfg, plan, {**diagnose_spec(args), **options})
    problems = spec.problems(world) + problems + early
    problems += diagnose_problems(args, plan)  # mini3d.diagnose: fault, budget and timeout flags
    if args.dry_run:  # validate, map, the recorded step's comm verdict, memory; starts nothing
        from mini3d.run.dryrun import dry_run

        return bad_input(problems) if problems else dry_run(cfg, plan, args.gpus_per_node,
                                                            grad_clip=args.grad_clip)
    if args.resume:
        resume, resume_problems = check_resume(args.resume, cfg, args.steps, args, plan)
        problems += resume_problems
        spec = spec.replace(resume=resume)
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else world
        choose_device(args.device, local, per_process=torchrun)
    except LaunchError as e:
        problems.append(str(e))
    if problems:
        return bad_input(problems)
    from .diagnose.cli import make_run_dir

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
    except WorkerError as e:
        code = stopped_while_starting(e, got)
        if code is not None:
            return code
        if e.message.startswith("NonFiniteLoss: "):
            print(f"mini3d train: {e.message[len('NonFiniteLoss: '):]}", file=sys.stderr)
            return EXIT_NONFINITE
        if e.message.startswith("OutOfMemory: "):  # the report is the whole story; no traceback
            print(f"mini3d train: {e.message[len('OutOfMemory: '):]}", file=sys.stderr)
            return EXIT_OOM
        return report_failure(e, spec.run_dir, EXIT_FAILED)
    except LaunchTimeout as e:
        return report_failure(e, spec.run_dir, EXIT_HUNG)
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
    from .diagnose.save_clock import checkpoint_bytes
    from .diagnose.watchdog import nccl_env
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
