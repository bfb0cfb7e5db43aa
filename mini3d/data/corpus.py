"""Training data that needs no download, tokenised simply and deterministically.

The embedded corpus is the English help text that ships inside CPython itself (`pydoc_data.topics`,
the text `help('if')` prints), about 465 kB. `--data PATH` trains on any text file instead.
Tokenisation is byte-level (vocabulary 256): lossless, deterministic, no files to fetch.

Batches are a pure function of (seed, step): step s draws its global batch of windows from a
generator seeded with (seed, s), so the data position is just the step number (a resumed run sees
exactly the batches an uninterrupted run would), and every rank can compute the global batch itself
and keep its own slice (dp replica, micro-batch) without any communication.

`--data DIR` reads the token shards `mini3d prepare` wrote (mini3d.data.shards), memory-mapped: a rank
reads only the windows of its own micro-batches, never the dataset.
"""

from __future__ import annotations

import math
import os
import pathlib

import torch

VOCAB_SIZE = 256


def embedded_corpus() -> bytes:
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


def load_tokens(path: str | None = None) -> torch.Tensor:
    """Byte tokens (int64) of the file at `path`, or of the embedded corpus."""
    if path is None:
        raw = embedded_corpus()
    else:
        with open(path, "rb") as f:
            raw = f.read()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def unigram_entropy(tokens: torch.Tensor) -> float:
    """Entropy (nats per token) of the byte distribution: the loss of a model that learned nothing
    but token frequencies. Falling well below it means the model learned context."""
    counts = torch.bincount(tokens, minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


class TensorTokens:
    """Tokens held in memory (a text file or the embedded corpus), as one segment."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens, self.lengths = tokens, [len(tokens)]

    def read(self, segment: int, start: int, n: int) -> torch.Tensor:
        return self.tokens[start:start + n]


class Batches:
    """Deterministic sampler of (input, target) windows: `global_batch` sequences of `seq_len`.

    `tokens` is a tensor, or a source of segments (`lengths`, `read(segment, start, n)`, e.g. the
    memory-mapped shards of `mini3d.data.shards.ShardTokens`); a window never crosses two segments, and
    only the windows a rank uses are read. `stream` separates independent batch sequences of the
    same seed (0: training, 1: validation)."""

    def __init__(self, tokens, seq_len: int, global_batch: int, seed: int = 0, stream: int = 0):
        self.source = TensorTokens(tokens) if isinstance(tokens, torch.Tensor) else tokens
        self.starts = [max(0, n - seq_len - 1) for n in self.source.lengths]  # windows per segment
        if sum(self.starts) < 1:
            raise ValueError(f"the data has {max(self.source.lengths, default=0)} tokens in its "
                             f"largest piece, fewer than seq_len+2={seq_len + 2}")
        self.cum = torch.tensor([0] + self.starts, device="cpu").cumsum(0)  # host-side index
        self.seq_len, self.global_batch, self.seed, self.stream = seq_len, global_batch, seed, stream

    def _starts(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + self.stream * 7_919_000_017)
        return torch.randint(0, int(self.cum[-1]), (self.global_batch,), generator=g, device="cpu")

    def _windows(self, starts: torch.Tensor):
        rows = []
        for s in starts.tolist():
            seg = int(torch.searchsorted(self.cum, s, right=True)) - 1
            rows.append(self.source.read(seg, s - int(self.cum[seg]), self.seq_len + 1))
        w = torch.stack(rows).long()
        return w[:, :-1], w[:, 1:]

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (global_batch, seq_len); y is x shifted by one token."""
        return self._windows(self._starts(step))

    def micro_batches(self, step: int, dp_index: int, dp: int, micro_batches: int):
        """This replica's micro-batches of step `step`: a list of (x, y), each (b, seq_len)."""
        per_replica = self.global_batch // dp
        x, y = self._windows(self._starts(step)[dp_index * per_replica:(dp_index + 1) * per_replica])
        return list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))


def open_tokens(data: str | None, tokenizer, split: str = "train"):
    """The token source of `--data`: a shard directory (memory-mapped, `split`), or a text file
    (or the embedded corpus) tokenised with `tokenizer` into memory (no split: None for "val")."""
    if data is not None and os.path.isdir(data):
        from mini3d.data.shards import ShardTokens, read_header

        header = read_header(data)
        return ShardTokens(data, split, header) if header[split]["tokens"] else None
    if split != "train":
        return None
    if tokenizer is None or tokenizer.name == "bytes":
        return load_tokens(data)
    text = embedded_corpus().decode("utf-8") if data is None else pathlib.Path(data).read_text("utf-8")
    return torch.tensor(tokenizer.encode(text), dtype=torch.long, device="cpu")


def shard_tokenizer(data: str | None) -> str | None:
    """The tokenizer a shard directory was made with (None for a text file or no --data)."""
    if data is None or not os.path.isdir(data):
        return None
    from mini3d.data.shards import read_header, tokenizer_name

    return tokenizer_name(data, read_header(data))


def has_validation_split(data: str | None) -> bool:
    if data is None or not os.path.isdir(data):
        return False
    from mini3d.data.shards import read_header

    return read_header(data)["val"]["tokens"] > 0


def check_data_path(path: str | None) -> str | None:
    """A problem with `--data`, or None."""
    if path is None:
        return None
    if os.path.isdir(path):
        from mini3d.data.shards import ShardError, read_header

        try:
            read_header(path)
        except ShardError as e:
            return str(e)
        return None
    if not os.path.isfile(path):
        return f"--data {path!r} does not exist or is not a file"
    if os.path.getsize(path) < 1024:
        return f"--data {path!r} holds {os.path.getsize(path)} bytes; at least 1024 are needed"
    return text_problem("--data", path)


def text_problem(flag: str, path: str, head: int = 1 << 20) -> str | None:
    """Why the file at `path` is not UTF-8 text (a NUL byte, or bytes UTF-8 cannot decode, in its
    first `head` bytes), naming the offset; None when it is. A binary file would otherwise be
    decoded with replacement characters, or its bytes trained on as if they were text."""
    import codecs

    with open(path, "rb") as f:
        data = f.read(head)
    nul = data.find(bytes(1))
    if nul >= 0:
        return (f"{flag} {path!r} is not text: a NUL byte at offset {nul} "
                f"(a binary file?)")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=len(data) < head)
    except UnicodeDecodeError as e:
        return (f"{flag} {path!r} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset "
                f"{e.start} (a binary file?)")
    return None


def bits(nats: float) -> float:
    return nats / math.log(2)
