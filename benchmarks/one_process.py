"""mini3d on one process against a plain PyTorch training loop (float32, CPU, the tiny model).

    python -m benchmarks.one_process [--quick]

One launched process runs both, taking turns `ROUNDS` times: `mini3d.run.train.train_worker` for a
one-process plan (world size 1: no tensor, pipeline or data parallelism, but mini3d's whole step:
the trainer, its records, the optimizer wrapper) and `benchmarks.plain_loop.plain_step_times` (the
same GPT with the same seed, the same batches, AdamW, nothing else). A repeat's time is the median
step of its round after the first `WARMUP` steps; the ratio is mini3d / plain per round. Goal:
1.05 (mini3d's step costs at most 5% more than the loop it wraps).
"""

from __future__ import annotations

import statistics
import sys

from mini3d.config import Plan
from mini3d.launch.launcher import launch
from mini3d.run.train import make_spec, reporter_records, train_worker

from .common import ratio_row
from .plain_loop import plain_step_times
from .train_runs import TINY

PLAN = Plan(global_batch=8, seq_len=64)  # one micro-batch of 8 x 64 tokens
WARMUP = 2


def _worker(rounds: int, steps: int) -> dict:
    ours, plain = [], []
    for _ in range(rounds):
        out = train_worker(make_spec(TINY, PLAN, steps=steps + WARMUP, seed=0))
        times = [r["step_time_s"] for r in reporter_records([out])[WARMUP:]]
        ours.append(statistics.median(times))
        got = plain_step_times(TINY, PLAN.global_batch, PLAN.seq_len, steps + WARMUP,
                               dtype="float32", seed=0)
        plain.append(statistics.median(got["times"][WARMUP:]))
    return {"ours": ours, "plain": plain}


def run(quick: bool = False) -> list[dict]:
    rounds, steps = (3, 8) if quick else (5, 16)
    (res,) = launch(_worker, 1, rounds, steps, device="cpu", timeout=300)
    return [ratio_row("one process mini3d vs a plain PyTorch loop (tiny, float32)", res["ours"],
                      res["plain"], goal=1.05,
                      note=f"{PLAN.global_batch}x{PLAN.seq_len} tokens/step; median step of "
                           f"{steps} per round, {rounds} rounds taking turns in one process")]


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
