"""Exercise a2a_volume: expert parallelism's all-to-all, its bytes, and the permutation it needs.

Chapter: 10 mixture of experts (course/10_mixture_of_experts.ipynb)

With ep ranks sharing one MoE layer's E experts (rank r holds experts r*E/ep .. (r+1)*E/ep - 1),
each rank routes its own tokens: token t goes to its top_k experts, so it becomes top_k
token-slots (slot t * top_k + j is token t's j-th expert). Before the all-to-all a rank sorts its
slots by destination, sends each rank its block (a row of d_model values per slot), and after the
experts have run and the combine all-to-all has brought the rows back, it puts them back in slot
order. Write the four pieces. Tensors are torch tensors; `experts` is (tokens, top_k) int64.
"""
from __future__ import annotations


def a2a_bytes(tokens: int, top_k: int, ep: int, d_model: int, element_bytes: int) -> float:
    """Bytes one rank sends in ONE all-to-all (the dispatch) for its `tokens` tokens when routing is
    perfectly balanced (every expert, hence every rank, receives the same number of slots)."""
    raise NotImplementedError("how many rows does one token put on the wire, and which share of "
                              "them has its expert on this very rank?")


def dispatch(experts, n_experts: int, ep: int):
    """(perm, splits): perm (tokens * top_k,) int64, the slot indices in the order they are sent:
    sorted by expert (so grouped by destination rank), slots of one expert in slot order; splits,
    a list of ep ints: how many slots go to each rank (this rank's own share included)."""
    raise NotImplementedError("flatten the slots; a stable sort by expert id groups them by rank, "
                              "since each rank's experts are contiguous")


def send_bytes(splits, rank: int, d_model: int, element_bytes: int) -> int:
    """Bytes rank `rank` actually puts on the wire in the dispatch, given its splits."""
    raise NotImplementedError("does the block a rank 'sends' to itself cross the wire?")


def undo(rows, perm):
    """rows (tokens * top_k, d) in dispatch order (row i belongs to slot perm[i]), back in slot order."""
    raise NotImplementedError("row i goes back to position perm[i]: the inverse permutation, not "
                              "the permutation applied a second time")
