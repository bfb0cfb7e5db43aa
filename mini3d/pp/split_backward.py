"""A stage's backward in two passes: B (the gradient of the stage input) now, W (the weights') later.

Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split each backward:
B computes only what the upstream stage waits for, the gradient of the stage input, and W computes
the parameter gradients afterwards, filling time the pipeline would otherwise idle.

How:

1. The runtime records a split micro-batch's forward under `mini3d.wgrad.deferring(store)`, one
   `WeightGradStore` per (stage, micro-batch): its linear layers become deferrable.
2. `backward_input` (B) runs one autograd pass from the stage output to the stage input and every
   parameter, with the store open: each linear layer computes its input gradient and stores
   (x, dy) instead of its weight gradient; the few other parameters (norms' scales, biases outside
   linears) get their gradients now, *held*, not accumulated into `.grad`. The graph is freed:
   what W needs is in the store.
3. `PendingWeightGrad.run` (W) computes the stored weight gradients (dW = dy^T x, db = sum dy)
   and accumulates them, with the held ones, in one autograd call whose roots are the parameters
   themselves: `.grad` and every post-accumulate-grad hook (data-parallel buckets, ZeRO) see
   them exactly as after an ordinary backward, and only in W, inside the data-parallel sync
   window the runtime opens for the stage's last W.

A stage without an input that needs a gradient (the first stage: token ids) has no B work: its W is
the ordinary full backward. Recomputation composes: a checkpointed block recomputes its forward
during B (under the same `deferring`, so the recomputed forward saves the same tensors); W needs
only the store. Inside a torch.compile region the linears are plain (see `mini3d.wgrad`), so a
compiled block's weight gradients are computed in B and held: correct, not split.
"""

from __future__ import annotations

import torch

from mini3d.wgrad import WeightGradStore, deferring


class PendingWeightGrad:
    """What W needs from B: the store of deferred linear work and the gradients B computed for
    the other parameters (or, for a stage without input gradient, the output and its gradient)."""

    def __init__(self, store: WeightGradStore | None = None, held=None, full=None):
        self.store = store
        self.held = held or []  # [(parameter, gradient)] computed by B, not yet accumulated
        self.full = full  # (output, grad) for a full backward in W

    def run(self):
        """Accumulate the parameter gradients into `.grad` (through their hooks); release all."""
        if self.full is not None:
            out, grad = self.full
            torch.autograd.backward(out, grad)
        pairs = self.held + (self.store.take() if self.store is not None else [])
        total: dict = {}  # a parameter used twice (a tied weight) gets one summed gradient
        for q, g in pairs:
            total[q] = g if q not in total else total[q] + g
        if total:
            torch.autograd.backward(list(total), list(total.values()))
        self.store, self.held, self.full = None, [], None


def backward_input(out: torch.Tensor, grad: torch.Tensor, inp: torch.Tensor | None, params,
                   store: WeightGradStore | None = None):
    """B: return (gradient of `inp`, PendingWeightGrad for W). `grad` is the gradient of `out`
    (for the last stage, the loss scale); `store` the one the forward was recorded with. With no
    `inp` needing a gradient, B does nothing."""
    if inp is None or not inp.requires_grad:
        return None, PendingWeightGrad(full=(out, grad))
    store = store if store is not None else WeightGradStore()
    params = [q for q in params if q.requires_grad]
    with store.collecting(), deferring(store):  # `deferring`: for recomputed forwards
        got = torch.autograd.grad(out, [inp] + params, grad, allow_unused=True)
    held = [(q, g) for q, g in zip(params, got[1:]) if g is not None]
    return got[0], PendingWeightGrad(store, held)


__all__ = ["backward_input", "PendingWeightGrad"]
