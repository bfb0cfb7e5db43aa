"""Sampling with the KV cache against sampling without it: tokens per second of `mini3d sample`'s
`generate` on the same tiny model, in one process, taking turns.

    python -m benchmarks.sample_bench [--quick]

Each round generates `n_new` tokens after a one-token prompt twice, cached (mini3d.models.kv_cache) and
uncached (the whole window for every token), with the same seed; the two must give the same ids.
Two lengths: inside the window (120 new tokens, max_seq_len 128: every step after the prompt is one
position) and past it (250: from token 128 on, the cache recomputes the last window each step, as
the uncached loop does, so only the first half gains); the tiny shape as a llama (GQA, 2 key/value
heads) past its window with the sliding cache (`--kv-slide`: one position per token throughout,
other tokens than the uncached loop past the window, by design); and the `small` preset (6 blocks of width
256, max_seq_len 256) inside its window, where the arithmetic the cache saves weighs more. The
ratio is cached / uncached time per round (< 1: the cache is faster); the note gives tokens/s of
each side and the speed-up (1 / the median ratio). At the tiny size a decode step is mostly per-op
overhead (4 blocks of small ops), not arithmetic, so the gain inside the window is about two, not
the window's length.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from mini3d.config import PRESETS
from mini3d.models.transformer import GPT
from mini3d.run.sample import generate

from .common import ratio_row

TINY, SMALL = PRESETS["tiny"], PRESETS["small"]
TINY_LLAMA = dataclasses.replace(TINY, family="llama", n_kv_heads=2, name="tiny-llama (gqa 4/2)")


def _time(model, n_new: int, kv_cache: bool, slide: bool = False) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    ids = generate(model, [10], n_new, temperature=1.0, top_k=0, seed=0, kv_cache=kv_cache,
                   slide=slide and kv_cache)
    return time.perf_counter() - t0, ids


def _row(model, n_new: int, rounds: int, slide: bool = False) -> dict:
    cfg = model.cfg
    cached, plain, same = [], [], True
    _time(model, 8, True), _time(model, 8, False)  # warm-up: first calls allocate and dispatch
    for _ in range(rounds):
        tc, ids_c = _time(model, n_new, True, slide)
        tp, ids_p = _time(model, n_new, False)
        cached.append(tc)
        plain.append(tp)
        same &= ids_c == ids_p
    kind = "sliding KV cache" if slide else "KV cache"
    row = ratio_row(f"sample {cfg.name}, {n_new} new tokens: {kind} / no cache", cached, plain)
    tps_c, tps_p = n_new / statistics.median(cached), n_new / statistics.median(plain)
    row["note"] = (f"{tps_c:,.0f} vs {tps_p:,.0f} tokens/s (medians), "
                   f"speed-up x{1 / row['ratio']:.2f} "
                   f"(median of rounds); max_seq_len "
                   f"{cfg.max_seq_len}; {rounds} rounds taking turns in one process; "
                   + ("same tokens" if same else "other tokens past the window (sliding-window "
                      "attention, by design)" if slide else "TOKENS DIFFER"))
    return row


def run(quick: bool = False) -> list[dict]:
    torch.set_num_threads(1)
    rounds = 3 if quick else 7
    tiny, small = GPT(TINY, seed=0).eval(), GPT(SMALL, seed=0).eval()
    llama = GPT(TINY_LLAMA, seed=0).eval()
    return [_row(tiny, 120, rounds), _row(tiny, 250, rounds), _row(llama, 250, rounds, slide=True),
            _row(small, 240, max(2, rounds // 2))]


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
