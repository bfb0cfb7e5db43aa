"""Token shards on disk: what `mini3d prepare` writes and `mini3d train --data DIR` memory-maps.

Layout of DIR:

    header.json        {"format", "tokenizer", "vocab_size", "dtype", "train": {"tokens", "shards"},
                        "val": {...}}; written last, so a DIR without it is unfinished
    train-00000.bin    flat uint16 (vocab <= 65536) or uint32 token ids, no header
    val-00000.bin      the held-out validation split, same format
    tokenizer.json     the tokenizer, when it is a file (trained with --train-tokenizer or copied)
    progress.json      prepare's resume point (shards done, documents consumed); removed at the end

The input is cut into *documents*: pieces of about `DOC_CHARS` characters of each input file, split at
line ends, in sorted file order. Each document gives its first (1 - f) tokens to train and the rest to
val. Shards close at document boundaries once `shard_tokens` train tokens are buffered; each shard is
written to `NAME.part` and renamed, and progress.json is then replaced (both atomic renames), so an
interrupted prepare resumes after its last complete shard and never leaves a shard that is listed
anywhere but was half written. train reads only the shards that header.json lists, after checking
each file's size against its token count.
"""

from __future__ import annotations

import json
import os

import numpy as np

FORMAT = "mini3d-shards/1"
DOC_CHARS = 1 << 18  # characters per document (the unit of resumption and of the val split)
HEADER, PROGRESS = "header.json", "progress.json"


class ShardError(ValueError):
    """A shard directory train cannot use; the message names it and what to do (exit 2)."""


def input_files(inputs: list[str]) -> list[str]:
    """Text files named by `inputs` (directories are walked), sorted, deduplicated."""
    out = []
    for item in inputs:
        if os.path.isdir(item):
            for root, _, names in os.walk(item):
                out += [os.path.join(root, n) for n in names]
        else:
            out.append(item)
    return sorted(set(os.path.abspath(p) for p in out))


def documents(files: list[str]):
    """(file, text) pieces of about DOC_CHARS characters, cut at line ends, in a fixed order."""
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            buf = []
            size = 0
            for line in f:
                buf.append(line)
                size += len(line)
                if size >= DOC_CHARS:
                    yield path, "".join(buf)
                    buf, size = [], 0
            if buf:
                yield path, "".join(buf)


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _write_atomic(path: str, data: bytes):
    part = path + ".part"
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _write_json(path: str, obj):
    _write_atomic(path, json.dumps(obj, indent=1).encode())


def write_shards(files: list[str], out: str, tok, tokenizer_ref: str, val_fraction: float,
                 shard_tokens: int, progress=None) -> dict:
    """Tokenise `files` into shards under `out` (resuming a previous run's progress.json); write
    header.json last and return it. `progress(n_chars)` is called as text is consumed."""
    dtype = token_dtype(tok.vocab_size)
    state_path = os.path.join(out, PROGRESS)
    state = {"docs": 0, "train": [], "val": []}
    if os.path.exists(state_path):
        with open(state_path) as f:
            state = json.load(f)
    bufs = {"train": [], "val": []}
    pending = 0

    def flush(docs_done: int):
        for split in ("train", "val"):
            if bufs[split]:
                arr = np.concatenate(bufs[split]).astype(dtype)
                name = f"{split}-{len(state[split]):05d}.bin"
                _write_atomic(os.path.join(out, name), arr.tobytes())
                state[split].append({"file": name, "tokens": int(arr.size)})
                bufs[split] = []
        state["docs"] = docs_done
        _write_json(state_path, state)

    seen = 0
    for i, (_, text) in enumerate(documents(files)):
        seen = i + 1
        if progress:
            progress(len(text))
        if i < state["docs"]:
            continue  # consumed by a previous, interrupted prepare
        ids = _encode(tok, text)
        n_val = int(round(len(ids) * val_fraction))
        bufs["train"].append(ids[:len(ids) - n_val])
        bufs["val"].append(ids[len(ids) - n_val:])
        pending += len(ids) - n_val
        if pending >= shard_tokens:
            flush(i + 1)
            pending = 0
    flush(max(seen, state["docs"]))
    header = {"format": FORMAT, "tokenizer": tokenizer_ref, "vocab_size": tok.vocab_size,
              "dtype": np.dtype(dtype).name}
    for split in ("train", "val"):
        shards = [s for s in state[split] if s["tokens"] > 0]
        header[split] = {"tokens": sum(s["tokens"] for s in shards), "shards": shards}
    _write_json(os.path.join(out, HEADER), header)
    os.remove(state_path)
    return header


def _encode(tok, text: str) -> np.ndarray:
    if tok.name == "bytes":  # the same ids as ByteTokenizer.encode, without a Python list
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    return np.asarray(tok.encode(text), dtype=np.int64)


def read_header(path: str) -> dict:
    """The header of shard directory `path`, after checking every listed shard's size."""
    hp = os.path.join(path, HEADER)
    if not os.path.isfile(hp):
        raise ShardError(f"--data {path!r} is a directory without {HEADER}: not a finished "
                         f"`mini3d prepare` output (an interrupted prepare resumes when run again)")
    with open(hp) as f:
        header = json.load(f)
    if header.get("format") != FORMAT:
        raise ShardError(f"{hp!r} has format {header.get('format')!r}, expected {FORMAT!r}")
    itemsize = np.dtype(header["dtype"]).itemsize
    for split in ("train", "val"):
        for s in header[split]["shards"]:
            fp = os.path.join(path, s["file"])
            size = os.path.getsize(fp) if os.path.isfile(fp) else -1
            if size != s["tokens"] * itemsize:
                raise ShardError(f"shard {fp!r} holds {max(size, 0)} bytes, its header says "
                                 f"{s['tokens']} tokens x {itemsize} bytes: rerun mini3d prepare")
    if header["train"]["tokens"] == 0:
        raise ShardError(f"--data {path!r} has no training tokens")
    return header


def tokenizer_name(path: str, header: dict) -> str:
    """The tokenizer a shard directory was made with, as get_tokenizer takes it."""
    ref = header["tokenizer"]
    return ref if ref in ("bytes", "gpt2") else os.path.join(os.path.abspath(path), ref)


class ShardTokens:
    """One split of a shard directory as memory-mapped segments: nothing is read until a window is."""

    def __init__(self, path: str, split: str = "train", header: dict | None = None):
        header = header or read_header(path)
        dtype = np.dtype(header["dtype"])
        self.segments = [np.memmap(os.path.join(path, s["file"]), dtype=dtype, mode="r",
                                   shape=(s["tokens"],)) for s in header[split]["shards"]]
        self.lengths = [len(s) for s in self.segments]

    def read(self, segment: int, start: int, n: int):
        import torch

        return torch.from_numpy(self.segments[segment][start:start + n].astype(np.int64))


__all__ = ["write_shards", "read_header", "ShardTokens", "ShardError", "input_files",
           "tokenizer_name", "token_dtype"]
