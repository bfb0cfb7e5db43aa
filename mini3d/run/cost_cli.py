"""`mini3d estimate | plan | calibrate`: the memory estimator, cost model and planner from a shell.

    mini3d estimate --model gpt-22b --tp 8 --global-batch 4 --seq-len 2048 --dtype bf16 \
        --sequence-parallel --recompute selective --gpu A100-80GB --json
    mini3d plan --model gpt-70b --gpus 8 --global-batch 32 --seq-len 4096 --dtype bf16 --top 5
    mini3d plan --model mixtral-8x7b --gpus 64 --global-batch 64 --seq-len 4096 --dtype bf16 --gpu H100-80GB
    mini3d calibrate --out cpu.json        # then: mini3d estimate --model tiny --gpu cpu.json

The model and plan flags are `mini3d train`'s (mini3d.run.flags): the same flags build the same
ModelConfig and Plan, with the same defaults (float32, seq_len 64, global batch 8: say --dtype bf16
and the sequence length for a GPU estimate). `plan` searches the layout (SEARCHED), so it takes no
layout flag; `estimate` derives dp from --gpus when --dp is not given.

Exit status: 0 answered (also for a layout that does not fit: the answer says so); 1 `plan` found
no fitting layout; 2 bad input, with a message naming every offending value (`BadInput`).
"""

from __future__ import annotations

import argparse
import json
import sys

from mini3d.config import ModelConfig, Plan, PlanError
from mini3d.exits import BadInput, bad_input
from mini3d.run import flags
from mini3d.cost.memory import GB, estimate_all_stages, gib
from mini3d.cost.hardware import PRESETS as GPUS
from mini3d.cost.hardware import load_hardware, save_hardware
from mini3d.models.presets import preset_notes


SEARCHED = ("tp", "pp", "dp", "cp", "ep", "zero", "schedule", "virtual_stages", "micro_batches",
            "recompute", "sequence_parallel", "bucket_mb", "grad_dtype", "compile",
            "expert_tp")  # by `plan` (expert_tp: not searched yet, its layouts keep experts whole)


def _hw_args(p):
    g = p.add_argument_group("hardware")
    g.add_argument("--gpu", default="A100-80GB", help=f"{' | '.join(GPUS)} | path.json "
                                                      f"(default: %(default)s)")
    g.add_argument("--gpus", type=int, help="number of GPUs (default tp*cp*pp*dp)")
    g.add_argument("--json", action="store_true", help="print the machine-readable answer")


def model_from_args(args) -> ModelConfig:
    """The model of the flags (mini3d.run.flags, as `mini3d train` builds it), or BadInput."""
    try:
        cfg = flags.model_from_args(args)
    except PlanError as e:
        raise BadInput("; ".join(e.problems)) from None
    problems = cfg.problems()
    if problems:
        raise BadInput("inconsistent model dimensions: " + "; ".join(problems))
    return cfg


def _hardware(args):
    try:
        return load_hardware(args.gpu)
    except (OSError, ValueError) as e:
        raise BadInput(f"--gpu {args.gpu!r}: {e}") from None


def plan_from_args(args, cfg: ModelConfig) -> Plan:
    """The plan of the flags; without --dp, dp = gpus / (tp * cp * pp) when --gpus is given."""
    derived = {}
    if args.dp is None and args.gpus:
        model_parallel = args.tp * args.pp * args.cp
        if args.gpus % model_parallel:
            raise BadInput(f"--gpus {args.gpus} is not a multiple of tp*pp*cp = {args.tp}*{args.pp}"
                           f"*{args.cp} = {model_parallel}")
        derived["dp"] = args.gpus // model_parallel
    plan = flags.plan_from_args(args, **derived)
    problems = plan.problems(cfg, args.gpus)
    if problems:
        raise BadInput("inconsistent plan: " + "; ".join(problems))
    return plan


def cmd_estimate(args) -> int:
    from mini3d.cost.model import estimate_cost
    from mini3d.cost.params import active_params_convention
    from mini3d.cost.planner import describe, why_not

    cfg = model_from_args(args)
    hw = _hardware(args)
    plan = plan_from_args(args, cfg)
    est = estimate_cost(cfg, plan, hw, args.gpus)
    stages = estimate_all_stages(cfg, plan)
    notes = preset_notes(cfg)  # what the preset's counts leave out (deepseek-v3: its MTP module)
    if cfg.n_experts:  # what "active" counts (the cards' "activated" leave the embedding out)
        notes.append(active_params_convention(cfg))
    if args.json:
        out = est.as_dict()
        out["memory_per_stage_bytes"] = [dict(s.as_dict(), detail=None) for s in stages]
        out["explanation"] = why_not(est)
        if notes:
            out["notes"] = notes
        print(json.dumps(out, indent=2))
        return 0
    print(f"{cfg.name} ({cfg.family}, {cfg.n_params() / 1e9:.1f}B parameters) on "
          f"{plan.world_size} x {hw.name}: {describe(plan)}")
    for note in notes:
        print(f"  note: {note}")
    for s in stages:
        print("  " + s.summary())
    print("  " + why_not(est))
    print(f"  step {est.step_time_s:.3f} s, {est.tokens_per_s:,.0f} tokens/s, "
          f"{est.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {est.mfu:.1%}, HFU {est.hfu:.1%}, "
          f"bubble {est.bubble_fraction:.1%}")
    print("  time: " + ", ".join(f"{k} {v:.3f} s" for k, v in est.breakdown.items()
                                 if k != "efficiency"))
    print("  bytes sent per rank per step: " + ", ".join(f"{k} {v / GB:.2f} GB"
                                                          for k, v in est.comm_bytes.items()))
    return 0


def cmd_plan(args) -> int:
    from mini3d.cost.planner import describe, search

    cfg = model_from_args(args)
    hw = _hardware(args)
    if not args.gpus or args.gpus < 1:
        raise BadInput(f"plan needs --gpus N >= 1 (got {args.gpus})")
    plan = flags.plan_from_args(args)  # the batch, sequence, dtype and attention: the rest is searched
    seq, batch = plan.seq_len, plan.global_batch
    if seq > cfg.max_seq_len:
        raise BadInput(f"--seq-len {seq} exceeds the model's max_seq_len={cfg.max_seq_len}")
    res = search(cfg, args.gpus, hw, batch, seq, plan.dtype, top_k=args.top,
                 attention=plan.attention)
    if args.json:
        print(json.dumps(res.as_dict(), indent=2))
    else:
        print(f"{cfg.name} on {args.gpus} x {hw.name}, global batch {batch}, seq_len {seq}: "
              f"{res.n_fit} of {res.n_considered} valid layouts fit")
        for i, c in enumerate(res.candidates, 1):
            print(f"  {i}. {describe(c.plan)}: {c.step_time_s:.3f} s, MFU {c.mfu:.1%}, "
                  f"{gib(c.memory.total)}")
        print(res.explanation)
        for note in res.notes:
            print(note)
    return 0 if res.fits else 1


def cmd_calibrate(args) -> int:
    from mini3d.cost.calibration import calibrate_machine

    hw = calibrate_machine(quick=args.quick)
    save_hardware(hw, args.out)
    print(json.dumps(hw.to_dict(), indent=2) if args.json else
          f"wrote {args.out}: matmul {hw.peak_flops / 1e9:.1f} GFLOP/s peak (half at width "
          f"{hw.eff_half_width:.0f}), all-reduce {hw.nvlink_bw / 1e9:.2f} GB/s + "
          f"{hw.latency_s * 1e6:.0f} us, memory {hw.memory_bw / 1e9:.1f} GB/s")
    return 0


def _check_counts(args):
    """Counts that must be >= 1 when given (0 or a negative one would pass for the default)."""
    for flag in ("seq_len", "top", "global_batch", "micro_batches", "virtual_stages"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise BadInput(f"--{flag.replace('_', '-')} {value} must be >= 1")
    out = getattr(args, "out", None)
    if args.command == "calibrate" and out:
        from mini3d.exits import file_target

        for problem in file_target("--out", out):
            raise BadInput(problem)


def _guard(fn):
    def run(args) -> int:
        try:
            _check_counts(args)
            return fn(args)
        except BadInput as e:
            return bad_input([str(e)], args.command, after="")
    return run


def register(subparsers) -> None:
    """Add `estimate`, `plan` and `calibrate` to an argparse subparsers object."""
    p = subparsers.add_parser("estimate", help="memory, step time and MFU of one plan",
                              description="Memory per rank and category, step time, MFU and bytes "
                                          "per axis of one plan, from the cost model.")
    flags.add_model_flags(p), flags.add_plan_flags(p), _hw_args(p)
    p.set_defaults(func=_guard(cmd_estimate), dp=None)  # None: not given (derived from --gpus)
    p = subparsers.add_parser("plan", help="search the fastest layouts that fit",
                              description="Search every layout of --gpus GPUs (tp, cp, pp, dp, ZeRO, "
                                          "schedule, micro-batches, recompute) for the fastest "
                                          "that fit.")
    flags.add_model_flags(p), flags.add_plan_flags(p, skip=SEARCHED), _hw_args(p)
    p.add_argument("--top", type=int, default=5, help="how many layouts to show")
    p.set_defaults(func=_guard(cmd_plan))
    p = subparsers.add_parser("calibrate", help="measure this machine into a hardware JSON")
    p.add_argument("--out", default="mini3d-hardware.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_guard(cmd_calibrate))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mini3d")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
