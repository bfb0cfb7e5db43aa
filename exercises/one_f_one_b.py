"""Exercise one_f_one_b: the order in which one pipeline rank runs its forwards and backwards.

Chapter: 05 pipeline parallelism (course/05_pipeline_parallelism.ipynb)
"""
from __future__ import annotations

def one_f_one_b(pp: int, pp_rank: int, micro_batches: int) -> list[str]:
    """Actions of pipeline rank `pp_rank` (of `pp`) under the non-interleaved 1F1B schedule.

    Actions are strings: "F3" is the forward of micro-batch 3, "B3" its backward. A rank first runs
    warm-up forwards (pp - pp_rank - 1 of them, at most micro_batches), then alternates one forward
    and one backward (steady state), then drains the remaining backwards in micro-batch order."""
    raise NotImplementedError('warm-up forwards: min(pp - pp_rank - 1, micro_batches); then pairs F, B; then the remaining backwards')
