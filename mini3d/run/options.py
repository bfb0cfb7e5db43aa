"""The `mini3d train` flags of a real run: tokenizer, validation, lr schedule, metrics, long runs.

`add_run_args(parser)` adds them; `run_options(args, cfg, fixed)` turns them into RunConfig fields
and the model config they imply: the model's vocabulary follows the tokenizer (tensor parallelism
pads it as always) unless --vocab is given, and --max-seq-len raises the position table. A model
`fixed` by a checkpoint or an HF directory keeps its own (mini3d.run.model_source), and a resumed run
reads with the checkpoint's tokenizer unless --tokenizer or --data DIR names one.
"""

from __future__ import annotations

import dataclasses
import sys

from mini3d.config import ModelConfig


def add_run_args(p):
    g = p.add_argument_group("text, validation, schedule, metrics (real runs)")
    g.add_argument("--tokenizer", help="bytes (default), gpt2, a .tiktoken file or a Hugging Face "
                                       "tokenizer.json; with --data DIR: the one DIR was made with")
    g.add_argument("--max-seq-len", type=int, metavar="N", help="the model's position table length")
    g.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="validation loss every N steps and at the end (needs --data DIR with a val split)")
    g.add_argument("--eval-batches", type=int, default=4, metavar="K", help="global batches per evaluation")
    g.add_argument("--lr-schedule", default="constant", help="constant, cosine or linear")
    g.add_argument("--warmup-steps", type=int, default=0, metavar="N", help="linear lr warmup steps")
    g.add_argument("--min-lr", type=float, default=0.0, help="where cosine / linear decay ends")
    g.add_argument("--decay-steps", type=int, default=0, metavar="N",
                   help="step at which the decay reaches --min-lr (default --steps)")
    g.add_argument("--weight-decay", type=float, default=0.0,
                   help="AdamW weight decay on the weight matrices (not biases, norms, embeddings)")
    g.add_argument("--decay-embeddings", action="store_true", help="weight decay on embeddings too")
    g.add_argument("--sample-every", type=int, default=0, metavar="N",
                   help="print a short sample every N steps (pp = 1)")
    g.add_argument("--tensorboard", metavar="DIR", help="TensorBoard event files (optional package)")
    g.add_argument("--keep-last", type=int, default=0, metavar="N", help="keep the newest N checkpoints")
    g.add_argument("--log-grad-norm", action="store_true",
                   help="record the global gradient norm every step, also without --grad-clip "
                        "(one more scalar all-reduce per axis and step)")
    g.add_argument("--log-every", type=int, default=10, metavar="N",
                   help="plain progress line every N steps when stderr is not a terminal")


def _resumed_tokenizer(args) -> str | None:
    """The tokenizer the checkpoint of --resume was trained with (None: none recorded)."""
    from mini3d.checkpoint.store import latest_dir, read_meta

    ckpt = latest_dir(args.resume) if getattr(args, "resume", None) else None
    try:
        return read_meta(ckpt).get("tokenizer") if ckpt else None
    except (OSError, ValueError, AttributeError):  # check_resume names a broken meta.json
        return None


def run_options(args, cfg: ModelConfig, fixed: bool = False) -> tuple[ModelConfig, dict, list[str]]:
    """(model config, RunConfig fields, problems) from the flags above; a `fixed` model (from a
    checkpoint or an HF directory) is returned as it is."""
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
    if args.max_seq_len is not None and not fixed:
        cfg = dataclasses.replace(cfg, max_seq_len=args.max_seq_len)
    try:
        tok = get_tokenizer(name)
        name = tok.name
    except TokenizerError:
        tok = None  # RunConfig.problems reports it
    if tok is not None and not fixed and args.vocab is None and cfg.vocab_size != tok.vocab_size:
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
    fields = dict(tokenizer=name, eval_every=args.eval_every, eval_batches=args.eval_batches,
                  lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr,
                  decay_steps=args.decay_steps, weight_decay=args.weight_decay,
                  decay_embeddings=args.decay_embeddings, sample_every=args.sample_every,
                  tensorboard=args.tensorboard, keep_last=args.keep_last, log_every=args.log_every,
                  log_grad_norm=args.log_grad_norm)
    return cfg, fields, problems
