"""A stage's backward in two passes: B (the gradient of the stage input) now, W (the weights') later.

Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") split each backward:
B computes only what the upstream stage waits for, the gradient of the stage input, and W computes
the parameter gradients afterwards, filling time the pipeline would otherwise idle.

How, with plain autograd (no change to the model's layers):

1. `backward_input` walks the micro-batch's autograd graph from the stage output. The *input path*
   is every node from which the stage input's gradient accumulator is reachable. For each parameter,
   it walks up from the parameter's accumulator through nodes off the input path; the first nodes it
   meets on the input path are the *split nodes* (for a linear layer: the matmul node, whose
   incoming gradient is both the layer's input gradient and its weight gradient's factor).
2. It registers a pre-hook on every split node that keeps the gradient arriving there, and runs
   `torch.autograd.grad(output, input, retain_graph=True)`: autograd executes only what the input
   needs, so no weight-gradient matmul runs; the graph (and every saved tensor W will need) stays.
3. `backward_weight` restarts autograd at each split node from its kept gradient
   (`GradientEdge`), asking only for that node's parameters, then drops the graph: W pays only for
   the weight-gradient work, and the saved tensors live from the forward until W.

A stage without an input that needs a gradient (the first stage: token ids) has no B work: its W is
the ordinary full backward. Recomputation composes: a checkpointed block recomputes its forward
when B first unpacks its saved tensors; W finds them in the retained graph.

Assumption, true for mini3d's GPT and for `BlockStage`: no parameter is used twice inside a stage
on paths that meet the input path at different nodes (no weight tying within a stage). PyTorch's
`torch.distributed.pipelining._backward` does the same split with parameter groups; this is a
smaller reading of the same idea.
"""

from __future__ import annotations

from collections import defaultdict, deque

import torch
from torch.autograd.graph import GradientEdge


def _node(t: torch.Tensor):
    """The autograd node that receives t's gradient (a leaf's AccumulateGrad, else grad_fn)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # the leaf's (cached) gradient accumulator


def _parents(root) -> dict:
    """{node: nodes that feed their gradient into it}, over the graph below `root`."""
    parents, seen, todo = defaultdict(list), {root}, deque([root])
    while todo:
        n = todo.popleft()
        for nxt, _ in n.next_functions:
            if nxt is None:
                continue
            parents[nxt].append(n)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return parents


def _upward(start, parents, stop=frozenset()) -> tuple[set, set]:
    """Nodes reachable from `start` against the gradient flow, not entering `stop`; and the
    `stop` nodes met on the way."""
    seen, met, todo = {start}, set(), deque([start])
    while todo:
        for up in parents.get(todo.popleft(), ()):
            if up in stop:
                met.add(up)
            elif up not in seen:
                seen.add(up)
                todo.append(up)
    return seen, met


class PendingWeightGrad:
    """What W needs from B: each split node with its kept gradient and the parameters below it
    (or, for a stage without input gradient, the whole output and its gradient)."""

    def __init__(self, groups=None, full=None):
        self.groups = groups or []  # [(node, [grad per node output], [params])]
        self.full = full  # (output, grad) for a full backward in W

    def run(self):
        """Accumulate the parameter gradients into `.grad` and release the graph."""
        if self.full is not None:
            out, grad = self.full
            torch.autograd.backward(out, grad)
        for node, grads, params in self.groups:
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            if edges:
                torch.autograd.backward([e for e, _ in edges], [g for _, g in edges],
                                        inputs=params)
        self.groups, self.full = [], None


def backward_input(out: torch.Tensor, grad: torch.Tensor, inp: torch.Tensor | None, params):
    """B: return (gradient of `inp`, PendingWeightGrad for W). `grad` is the gradient of `out`
    (for the last stage, the loss scale). With no `inp` needing a gradient, B does nothing."""
    if inp is None or not inp.requires_grad:
        return None, PendingWeightGrad(full=(out, grad))
    root = out.grad_fn
    parents = _parents(root)
    on_path, _ = _upward(_node(inp), parents)
    split: dict = {}  # split node -> its parameters
    for q in params:
        if not q.requires_grad:
            continue
        _, met = _upward(_node(q), parents, stop=on_path)
        for n in met:
            split.setdefault(n, []).append(q)
    kept: dict = {}
    hooks = [n.register_prehook(lambda g, n=n: kept.__setitem__(n, g)) for n in split]
    try:
        (dinp,) = torch.autograd.grad(out, inp, grad, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    groups = [(n, list(kept[n]), qs) for n, qs in split.items() if n in kept]
    return dinp, PendingWeightGrad(groups)


__all__ = ["backward_input", "PendingWeightGrad"]
