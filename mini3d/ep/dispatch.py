"""Expert parallelism's token exchange: a differentiable all-to-all and the MoE dispatch/combine.

Under `--ep N` a MoE layer's E routed experts are split over the N ranks of an ep group (rank j
holds experts j*E/N .. (j+1)*E/N - 1). Each rank routes its own tokens with the full (replicated)
router and applies the capacity rule to them, exactly as the one-process run does for that rank's
micro-batch, then hands `ExpertDispatch` the kept token-slots' rows sorted by expert and the count
per expert (E,). The dispatch:

1. exchanges the counts: an all-to-all of the (N, E/N) count table, so each rank learns how many
   rows every member sends to each of its local experts;
2. dispatches the rows (`all_to_all`, differentiable): member j's block is the rows of j's experts,
   contiguous because the rows are sorted by expert;
3. regroups the received rows by local expert (they arrive by source rank, then expert) and runs
   the E/N local experts as one grouped GEMM (`Experts.forward`);
4. undoes the regrouping and returns every row to the rank it came from (combine: the reverse
   all-to-all), in the order the caller sent them, which weights and sums them as without ep.

Backward is the same exchanges reversed (`_AllToAll.backward`): the gradient of the combine goes
to the experts' ranks, that of the dispatch back to the tokens' ranks. An expert's weight gradient
therefore already sums the contributions of the whole ep group's tokens (mini3d.dp.ddp,
"Expert parallelism", divides accordingly).

Worked example, ep=2, E=4 (rank 0 holds experts 0, 1; rank 1 holds 2, 3), rank 0's counts
[3, 1, 0, 2] and rank 1's [1, 1, 2, 0]: rank 0 sends 4 rows to itself and 2 to rank 1, receives 4
from itself and 2 from rank 1 ([1, 1]: one for expert 0, one for expert 1); its experts then see
3 + 1 = 4 and 1 + 1 = 2 rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mini3d import comm


class _AllToAll(torch.autograd.Function):
    """Rows `in_splits[j]` of x to member j, `out_splits[j]` rows from member j; backward: the
    reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, axis, out_splits, in_splits):
        ctx.axis, ctx.splits = axis, (list(out_splits), list(in_splits))
        out = x.new_zeros((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), axis, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        gx = grad.new_zeros((sum(in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all(gx, grad.contiguous(), ctx.axis, in_splits, out_splits)
        return gx, None, None, None


def all_to_all(x: torch.Tensor, axis, out_splits, in_splits) -> torch.Tensor:
    """Differentiable all-to-all along dim 0 over `axis` (identity on a one-member axis)."""
    if axis.size == 1:
        return x
    return _AllToAll.apply(x, axis, list(out_splits), list(in_splits))


def exchange_counts(counts: torch.Tensor, axis) -> torch.Tensor:
    """(N, E/N): row j = the rows member j sends to each of this rank's local experts, from this
    rank's counts per expert (E,) (an all-to-all of one row of the count table per member)."""
    n = axis.size
    mine = counts.view(n, -1).contiguous()
    theirs = torch.empty_like(mine)
    comm.all_to_all(theirs, mine, axis)
    if _recording_only(axis):  # the dry run's fake group moves no data: as if every member
        return mine.clone()  # routed as this one, so the recorded exchanges have consistent sizes
    return theirs


def _recording_only(axis) -> bool:
    """Is the axis' group torch's fake backend (mini3d.run.dryrun records on it)?"""
    return axis.group is not None and dist.get_backend(axis.group) == "fake"


def by_local_expert(recv: torch.Tensor) -> torch.Tensor:
    """The order that regroups received rows (by source, then local expert: the blocks of the
    (N, E/N) table `recv`) by local expert, then source (stable inside each block)."""
    n, local = recv.shape
    block = torch.repeat_interleave(torch.arange(n * local, device=recv.device), recv.flatten())
    return torch.argsort((block % local) * n + block // local, stable=True)


class ExpertDispatch:
    """A MoE layer's experts under expert parallelism (see the module docstring): `MoE.forward`
    calls it where it would call its (local) `Experts` with all the rows. Not a Module: it holds
    no parameters of its own, so the layer's parameter names stay those of the reference."""

    def __init__(self, experts, axis):
        self.experts, self.axis = experts, axis

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (M, d) sorted by global expert, counts (E,): the experts' outputs, row for row."""
        axis = self.axis
        recv = exchange_counts(counts, axis)  # (N, E/N)
        send_splits = counts.view(axis.size, -1).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        got = all_to_all(rows, axis, recv_splits, send_splits)  # dispatch
        order = by_local_expert(recv)
        out = self.experts(got[order], recv.sum(0))
        back = out[torch.argsort(order)]  # by source rank again
        return all_to_all(back, axis, send_splits, recv_splits)  # combine
