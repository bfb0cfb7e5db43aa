"""The run options of `mini3d train` that the plan does not cover, checked before any process
starts, and the resume checks (the checkpoint's files, model, step, seed, data and batch against
this run's).

Each problem names the flag, the value and what would fit. `Plan.problems` covers the parallel
layout and `diagnose_problems` the diagnostics flags; this covers numbers that must be finite and
positive, paths that must be writable where they point, and options that only make sense together.
"""

from __future__ import annotations

import math
import os
import sys

from mini3d.config import ModelConfig, Plan
from mini3d.exits import dir_target as _dir_target, file_target as _file_target


def _finite(flag: str, value, positive: bool = True) -> list[str]:
    if value is None:
        return []
    if not math.isfinite(value):
        return [f"{flag} {value} must be a finite number"]
    if positive and value <= 0:
        return [f"{flag} {value} must be > 0"]
    return []


def host_memory_problem(args, cfg, plan=None) -> list[str]:
    """A CPU run that cannot fit this host: the model states of every parameter (weights,
    gradients and AdamW moments at `cost.memory.state_bytes` of float32, 16 bytes, however the
    layout splits them), and every rank's activations of its micro-batches at their peak (the
    estimator's), against its physical memory. (GPU runs are the memory estimator's and the OOM
    report's.)"""
    from mini3d.launch.devices import visible_gpus

    if cfg.problems() or args.device not in ("cpu", "auto") or (args.device == "auto" and
                                                                 visible_gpus()):
        return []  # (an inconsistent model is named by its own check)
    from mini3d.cost.memory import estimate_all_stages, state_bytes

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = cfg.n_params() * sum(state_bytes("float32"))
    if need > ram:
        return [f"the model ({cfg.n_params():,} parameters, d_model={cfg.d_model}, n_layers="
                f"{cfg.n_layers}) needs at least {need / 2**30:,.1f} GiB for its weights, gradients "
                f"and AdamW moments, more than this host's {ram / 2**30:,.1f} GiB of memory"]
    if plan is None or plan.problems(cfg):
        return []
    acts = sum(e.activations for e in estimate_all_stages(cfg, plan)) * plan.tp * plan.cp * plan.dp
    if acts > ram:
        return [f"--global-batch {plan.global_batch} --seq-len {plan.seq_len} (micro-batches of "
                f"{plan.micro_batch_size:,} sequences) need about {acts / 2**30:,.1f} GiB of "
                f"activations over the job's ranks, more than this host's {ram / 2**30:,.1f} GiB "
                f"of memory (more --micro-batches, a smaller --global-batch or --seq-len)"]
    return []


def run_problems(args, plan, cfg) -> list[str]:
    """Every reason the run options of `args` cannot work (see the module docstring)."""
    out = []
    out += _finite("--lr", args.lr) + _finite("--timeout", args.timeout)
    for flag, value in (("--grad-clip", args.grad_clip), ("--bucket-mb", args.bucket_mb),
                        ("--hang-timeout", args.hang_timeout)):  # their signs are checked elsewhere
        out += _finite(flag, value, positive=False)
    if args.world_size is not None and args.world_size < 1:
        out.append(f"--world-size {args.world_size} must be >= 1 (default: tp*pp*dp)")
    if args.save_every < 0:
        out.append(f"--save-every {args.save_every} must be >= 0 (0: only at the end)")
    elif args.save_every and not args.save:
        out.append(f"--save-every {args.save_every} needs --save DIR (where the checkpoints go)")
    if getattr(args, "async_save", False) and not args.save:
        out.append("--async-save needs --save DIR (where the checkpoints go)")
    if plan.sequence_parallel and plan.tp == 1:
        out.append("--sequence-parallel needs --tp > 1 (it shards the LayerNorm regions over tp)")
    out += host_memory_problem(args, cfg, plan)
    out += _file_target("--log-jsonl", args.log_jsonl)
    out += _dir_target("--save", args.save)
    out += _dir_target("--run-dir", args.run_dir)
    if args.memory_budget is not None:
        from mini3d.diagnose.faults import parse_size

        try:
            if parse_size(args.memory_budget) <= 0:
                out.append(f"--memory-budget {args.memory_budget} must be > 0 bytes")
        except ValueError:
            pass  # diagnose_problems names it
    if args.data and os.path.isfile(args.data) and isinstance(plan.seq_len, int):
        tokens = os.path.getsize(args.data)  # byte tokens: one per byte
        if tokens < plan.seq_len + 2:
            out.append(f"--data {args.data!r} holds {tokens} tokens, fewer than seq_len+2="
                       f"{plan.seq_len + 2} (one window and its target): lower --seq-len or give "
                       f"more data")
    return out


def resume_changes(meta: dict, args, plan) -> list[str]:
    """What differs between a checkpoint's run and the one asked for, among what decides the
    batches: the seed, the data file and the global batch (checkpoints that did not record one of
    them are not compared on it). A step-0 checkpoint (`mini3d import-hf`) has no batches behind it
    to continue, so nothing is compared."""
    out = []
    if int(meta.get("step", 0)) == 0:
        return out
    if "seed" in meta and meta["seed"] != args.seed:
        out.append(f"--seed {args.seed} differs from the checkpoint's seed {meta['seed']}")
    if "data" in meta:
        data = os.path.abspath(args.data) if args.data else None
        if data != meta["data"]:
            out.append(f"--data {args.data!r} differs from the checkpoint's data "
                       f"{meta['data'] or 'the embedded corpus'!r}")
    tokenizer = getattr(args, "tokenizer", None)
    named = ("bytes", "gpt2")  # a file's tokenizer is named by its content: not compared here
    if tokenizer in named and meta.get("tokenizer") in named and meta["tokenizer"] != tokenizer:
        out.append(f"--tokenizer {tokenizer!r} differs from the checkpoint's {meta['tokenizer']!r}")
    saved = (meta.get("plan") or {}).get("global_batch")
    if saved is not None and saved != plan.global_batch:
        out.append(f"--global-batch {plan.global_batch} differs from the checkpoint's {saved}")
    return out


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
        changes = resume_changes(meta, args, plan)
        if changes and not args.allow_change:
            out += [f"{c} (the resumed run would not see the batches of an uninterrupted one; "
                    f"pass --allow-change to resume anyway)" for c in changes]
        for c in changes if args.allow_change else ():
            print(f"mini3d train: warning: {c}; resuming anyway (--allow-change)", file=sys.stderr)
    return ckpt, out


__all__ = ["run_problems", "resume_changes", "check_resume"]
