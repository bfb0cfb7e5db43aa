"""The tokenizer of a `mini3d train` run, and the model's vocabulary that follows from it.

`run_options(args, cfg, fixed)`: the tokenizer is --tokenizer, else the one a `--data DIR` was made
with, else the resumed checkpoint's, else bytes; the model's vocabulary follows it (tensor
parallelism pads it as always) unless --vocab is given. A model `fixed` by a checkpoint or an HF
directory keeps its own (mini3d.run.model_source). Also the options that need pp = 1 or an
optional package.
"""

from __future__ import annotations

import dataclasses
import sys

from mini3d.config import ModelConfig


def _resumed_tokenizer(args) -> str | None:
    """The tokenizer the checkpoint of --resume was trained with (None: none recorded)."""
    from mini3d.checkpoint.store import latest_dir, read_meta

    ckpt = latest_dir(args.resume) if getattr(args, "resume", None) else None
    try:
        return read_meta(ckpt).get("tokenizer") if ckpt else None
    except (OSError, ValueError, AttributeError):  # check_resume names a broken meta.json
        return None


def run_options(args, cfg: ModelConfig, fixed: bool = False) -> tuple[ModelConfig, str, list[str]]:
    """(model config, tokenizer name, problems); a `fixed` model (from a checkpoint or an HF
    directory) is returned as it is."""
    from mini3d.data.corpus import shard_tokenizer
    from mini3d.run.report import tensorboard_problem
    from mini3d.data.shards import ShardError
    from mini3d.data.tokenizer import TokenizerError, get_tokenizer, vocab_warning

    problems = []
    name = args.tokenizer or "bytes"
    try:
        made_with = shard_tokenizer(args.data)
    except (ShardError, OSError):
        made_with = None  # RunConfig.problems reports the data problem
    if made_with and not args.tokenizer:
        name = made_with
    elif not args.tokenizer:
        name = _resumed_tokenizer(args) or name
    try:
        tok = get_tokenizer(name)
        name = tok.name
    except TokenizerError:
        tok = None  # RunConfig.problems reports it
    if tok is not None and not fixed and args.vocab_size is None and cfg.vocab_size != tok.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size)  # the vocabulary follows it
    if tok is not None:
        warning = vocab_warning(cfg.vocab_size, cfg.d_model, tok)
        if warning:
            print(f"mini3d train: {warning}", file=sys.stderr)
    if args.sample_every and args.pp > 1:
        problems.append(f"--sample-every {args.sample_every} needs pp=1 (got pp={args.pp}): "
                        f"sample a checkpoint with `mini3d sample` instead")
    tb = tensorboard_problem(args.tensorboard)
    if tb:
        problems.append(tb)
    return cfg, name, problems
