"""Training data that needs no download, tokenised simply and deterministically.

The embedded corpus is the English help text that ships inside CPython itself (`pydoc_data.topics`,
the text `help('if')` prints), about 465 kB. `--data PATH` trains on any text file instead.
Tokenisation is byte-level (vocabulary 256): lossless, deterministic, no files to fetch.

Batches are a pure function of (seed, step): step s draws its global batch of windows from a
generator seeded with (seed, s), so the data position is just the step number (a resumed run sees
exactly the batches an uninterrupted run would), and every rank can compute the global batch itself
and keep its own slice (dp replica, micro-batch) without any communication.
"""

from __future__ import annotations

import math
import os

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


class Batches:
    """Deterministic sampler of (input, target) windows: `global_batch` sequences of `seq_len`."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int = 0):
        if len(tokens) < seq_len + 2:
            raise ValueError(f"the data has {len(tokens)} tokens, fewer than seq_len+2={seq_len + 2}")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (global_batch, seq_len); y is x shifted by one token."""
        g = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.global_batch,), generator=g,
                               device="cpu")
        idx = starts[:, None] + torch.arange(self.seq_len + 1, device="cpu")
        w = self.tokens[idx]
        return w[:, :-1], w[:, 1:]

    def micro_batches(self, step: int, dp_index: int, dp: int, micro_batches: int):
        """This replica's micro-batches of step `step`: a list of (x, y), each (b, seq_len)."""
        x, y = self.global_batch_at(step)
        per_replica = self.global_batch // dp
        x = x[dp_index * per_replica:(dp_index + 1) * per_replica]
        y = y[dp_index * per_replica:(dp_index + 1) * per_replica]
        return list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))


def check_data_path(path: str | None) -> str | None:
    """A problem with `--data`, or None."""
    if path is None:
        return None
    if not os.path.isfile(path):
        return f"--data {path!r} does not exist or is not a file"
    if os.path.getsize(path) < 1024:
        return f"--data {path!r} holds {os.path.getsize(path)} bytes; at least 1024 are needed"
    return None


def bits(nats: float) -> float:
    return nats / math.log(2)
