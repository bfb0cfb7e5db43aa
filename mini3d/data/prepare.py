"""`mini3d prepare INPUT... --out DIR --tokenizer NAME [--train-tokenizer VOCAB] [--val-fraction F]`.

Text files (or directories of them) become token shards that `mini3d train --data DIR` memory-maps
(format, atomicity and resumption: mini3d.data.shards). With `--train-tokenizer VOCAB` a byte-level BPE
of VOCAB tokens is first trained on the same text with the `tokenizers` library and stored as
DIR/tokenizer.json, so a subword tokenizer needs no network. A tokenizer given as a file is copied
into DIR, so the directory is self-contained. Run it again after an interruption: it resumes.
A prepare holds an exclusive flock on DIR while it writes: a second one into the same DIR is exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from mini3d.data.shards import HEADER, PROGRESS, input_files


def register(sub):
    p = sub.add_parser("prepare", help="tokenise text files into memory-mappable token shards",
                       description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files or directories of them")
    p.add_argument("--out", required=True, metavar="DIR", help="where the shards and header go")
    p.add_argument("--tokenizer", default="bytes", help="bytes, gpt2, a .tiktoken file or a "
                                                         "Hugging Face tokenizer.json")
    p.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                   help="train a byte-level BPE of VOCAB tokens on the inputs (tokenizers library)")
    p.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                   help="share of each document held out for validation (default 0.05)")
    p.add_argument("--shard-tokens", type=int, default=1 << 24, metavar="N",
                   help="training tokens per shard file (default 16Mi)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_prepare)


def prepare_problems(args, files: list[str]) -> list[str]:
    from mini3d.data.corpus import text_problem
    from mini3d.exits import dir_target

    out = [f"INPUT {p!r} does not exist" for p in args.inputs if not os.path.exists(p)]
    if not out and not files:
        out.append(f"INPUT {' '.join(args.inputs)!r} holds no files")
    elif files and sum(os.path.getsize(p) for p in files) == 0:
        out.append(f"INPUT {' '.join(args.inputs)!r} holds 0 bytes of text (nothing to tokenise)")
    out += [t for t in (text_problem("INPUT", p) for p in files) if t]
    out += dir_target("--out", args.out)
    if not 0 <= args.val_fraction < 1:
        out.append(f"--val-fraction {args.val_fraction} must be in [0, 1)")
    if args.shard_tokens < 1:
        out.append(f"--shard-tokens {args.shard_tokens} must be >= 1")
    if args.train_tokenizer is not None:
        if args.tokenizer != "bytes":
            out.append(f"--train-tokenizer trains a new tokenizer; drop --tokenizer {args.tokenizer}")
        if not 257 <= args.train_tokenizer <= 1 << 20:
            out.append(f"--train-tokenizer {args.train_tokenizer} must be in [257, {1 << 20}] "
                       f"(a byte-level BPE starts from the 256 bytes)")
    return out


def _settings(args, files) -> dict:
    return {"inputs": files, "tokenizer": args.tokenizer, "train_tokenizer": args.train_tokenizer,
            "val_fraction": args.val_fraction, "shard_tokens": args.shard_tokens}


def _settings_problem(args, files) -> str | None:
    """Why `--out` cannot take this prepare: its settings.json is another prepare's, or damaged."""
    path = os.path.join(args.out, "settings.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            same = json.load(f) == _settings(args, files)
    except (OSError, ValueError) as e:
        return (f"--out {args.out!r}: {path} is damaged ({str(e).splitlines()[0][:80]}): delete "
                f"the directory to start over, or choose another --out")
    if not same:
        return (f"--out {args.out!r} holds a prepare with other inputs or settings "
                f"(see {path}): choose another --out or delete it")
    return None


def _lock(out: str):
    """A file descriptor holding an exclusive flock on the directory `out`, or None when another
    prepare holds it (it is writing there: its temporary files and progress.json are its own)."""
    import fcntl

    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def cmd_prepare(args) -> int:
    from mini3d.exits import bad_input
    from mini3d.data.tokenizer import TokenizerError, get_tokenizer

    files = input_files(args.inputs) if all(os.path.exists(p) for p in args.inputs) else []
    problems = prepare_problems(args, files)
    tok = None
    if not problems and args.train_tokenizer is None:
        try:
            tok = get_tokenizer(args.tokenizer)
        except TokenizerError as e:
            problems.append(str(e))
    if problems:
        return bad_input(problems, "prepare")
    created = not os.path.isdir(args.out)
    os.makedirs(args.out, exist_ok=True)
    fd = _lock(args.out)
    if fd is None:
        return bad_input([f"--out {args.out!r}: another mini3d prepare is writing there (it holds "
                          f"the directory's lock): wait for it to finish, or choose another --out"],
                         "prepare")
    try:
        problem = _settings_problem(args, files)
        if problem:
            if created:
                shutil.rmtree(args.out, ignore_errors=True)
            return bad_input([problem], "prepare")
        return _prepare(args, files, tok)
    finally:
        os.close(fd)


def _prepare(args, files, tok) -> int:
    """The prepare itself, under the lock of `--out`: settings, tokenizer, shards, header."""
    from mini3d.data.tokenizer import get_tokenizer, train_bpe

    if os.path.exists(os.path.join(args.out, HEADER)):
        print(f"mini3d prepare: {args.out} is already complete", file=sys.stderr)
        return 0
    with open(os.path.join(args.out, "settings.json"), "w") as f:
        json.dump(_settings(args, files), f, indent=1)
    if os.path.exists(os.path.join(args.out, PROGRESS)):
        print(f"mini3d prepare: resuming the interrupted prepare in {args.out}", file=sys.stderr)
    ref = args.tokenizer
    if args.train_tokenizer is not None:
        ref = "tokenizer.json"
        path = os.path.join(args.out, ref)
        if os.path.exists(path):
            tok = get_tokenizer(path)  # trained by the interrupted run
        else:
            from mini3d.data.shards import documents

            tok = train_bpe((text for _, text in documents(files)), args.train_tokenizer, path)
            print(f"mini3d prepare: trained a byte-level BPE of {tok.vocab_size} tokens -> {path}",
                  file=sys.stderr)
    elif ref not in ("bytes", "gpt2"):
        ref = "tokenizer.tiktoken" if tok.name.endswith(".tiktoken") else "tokenizer.json"
        if not os.path.exists(os.path.join(args.out, ref)):
            shutil.copyfile(tok.name, os.path.join(args.out, ref))
    header = _write(args, files, tok, ref)
    print(f"mini3d prepare: {header['train']['tokens']:,} train + {header['val']['tokens']:,} val "
          f"tokens ({header['dtype']}, vocabulary {header['vocab_size']}) in "
          f"{len(header['train']['shards'])} + {len(header['val']['shards'])} shards -> {args.out}")
    return 0


def _write(args, files, tok, ref) -> dict:
    from tqdm.auto import tqdm

    from mini3d.data.shards import write_shards

    total = sum(os.path.getsize(p) for p in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=args.no_progress or None)
    try:
        return write_shards(files, args.out, tok, ref, args.val_fraction, args.shard_tokens,
                            progress=lambda n: bar.update(n))
    finally:
        bar.close()
