"""Exercise zb_h1: the order in which one pipeline rank runs ZB-H1's forwards, input-gradient
backwards (B) and weight-gradient backwards (W).

Chapter: 05 pipeline parallelism (course/05_pipeline_parallelism.ipynb)
"""
from __future__ import annotations


def zb_h1(pp: int, pp_rank: int, micro_batches: int) -> list[str]:
    """Actions of pipeline rank `pp_rank` (of `pp`, micro_batches >= pp) under ZB-H1.

    Actions are strings: "F3" the forward of micro-batch 3, "B3" the gradient of the stage's input
    (what the previous stage waits for), "W3" the gradients of the stage's weights (nobody waits).
    F and B sit where 1F1B puts its forwards and backwards: pp - pp_rank - 1 warm-up forwards, then
    one forward (while any remain) and one B at a time. The W of a micro-batch runs pp_rank
    micro-batches late: after the k-th B (counting from 0) comes the oldest waiting W once
    k >= pp_rank; the W still waiting at the end run last, in micro-batch order."""
    raise NotImplementedError('start from your 1F1B; B replaces the backward; add each W pp_rank micro-batches late')
