"""Exercise one_f_one_b: the order in which one pipeline rank runs its forwards and backwards.

Chapter: 05 pipeline parallelism (course/05_pipeline_parallelism.ipynb)
"""
from __future__ import annotations

def one_f_one_b(pp: int, pp_rank: int, micro_batches: int) -> list[str]:
    """Actions of pipeline rank `pp_rank` (of `pp`) under the non-interleaved 1F1B schedule.

    Actions are strings: "F3" is the forward of micro-batch 3, "B3" its backward. A rank first runs
    warm-up forwards, as many as keep it busy until the first backward can reach it (micro-batch 0
    must first pass every later stage and come back; the last rank needs none), then alternates one
    forward and one backward (steady state, which starts with a forward), then drains the remaining
    backwards in micro-batch order. The forwards run before the first backward are also the most
    micro-batches the rank ever holds (the grader's `warmup` and `in_flight` checks count them).
    micro_batches may be smaller than pp: then the first ranks run every forward before any
    backward. Example, pp=4, micro_batches=6:

        rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5
        rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"""
    raise NotImplementedError("a rank's first backward can start only after that micro-batch has been through every later stage and back: how many forwards fit in that wait? Then alternate, then drain")
