"""Exercise one_f_one_b: the order in which one pipeline rank runs its forwards and backwards.

Chapter: 05 pipeline parallelism (course/05_pipeline_parallelism.ipynb)
"""

from __future__ import annotations


def one_f_one_b(pp: int, pp_rank: int, micro_batches: int) -> list[str]:
    """Actions of pipeline rank `pp_rank` (of `pp`) under the non-interleaved 1F1B schedule.

    Actions are strings: "F3" is the forward of micro-batch 3, "B3" its backward. A rank first runs
    warm-up forwards (pp - pp_rank - 1 of them, at most micro_batches), then alternates one forward
    and one backward (steady state, which starts with a forward), then drains the remaining
    backwards in micro-batch order. So min(pp - pp_rank, micro_batches) forwards run before the first
    backward (the grader's `warmup` check counts those), and that is also the most micro-batches the
    rank ever holds. micro_batches may be smaller than pp: then the first ranks run every forward
    before any backward. Example, pp=4, micro_batches=6:

        rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5
        rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"""
    warmup = min(pp - pp_rank - 1, micro_batches)
    actions = [f"F{mb}" for mb in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [f"F{warmup + i}", f"B{i}"]
    actions += [f"B{mb}" for mb in range(micro_batches - warmup, micro_batches)]
    return actions
