"""Regional compilation (`Plan.compile`, `mini3d train --compile`): each transformer block's
forward goes through `torch.compile` on its own, as torchtitan compiles each TransformerBlock.

Why per block, not the whole model: the blocks of a model share one code object and one shape,
so the first block's graphs serve every other block (a cold start of one block's compile, not the
model's), and the parts around the blocks (embedding, head, pipeline and data-parallel machinery)
stay ordinary Python.

What runs inside the compiled graphs, and what stays outside:

* the per-rank compute between two collectives (norms, the q/k/v and MLP matmuls, rotary, the
  attention core, activations, residual adds) is traced and compiled;
* every collective stays outside: the tensor-parallel mappings (`f`, `g`, the sequence-parallel
  gather / reduce-scatter, mini3d.tp.mappings) and ring attention (mini3d.cp) are marked
  `outside_graphs` and wrapped in `torch.compiler.disable` at the first compile (mini3d.graph_breaks), so dynamo breaks the graph there and runs them eagerly through
  `mini3d.comm`. Functional collectives inside the graph would let inductor reorder them, but they
  would bypass mini3d's event log (the hang watchdog, explain-hang and the measured bytes read it)
  and tie parity to inductor's scheduling; graph breaks keep the collectives exactly as in eager
  mode, at the price of a few graphs per block instead of one (on one tp rank there is no
  collective at all and a block is one graph);
* module hooks stay outside too: the block's *forward* is compiled, not its `__call__`, so
  ZeRO-3's gather / free hooks and the data-parallel gradient hooks run eagerly around it.

Composition with recomputation (mini3d.recompute): compile runs first, so full recomputation wraps
the compiled forward in `torch.utils.checkpoint` and the recomputation in backward replays the same
compiled graphs (the saved-tensor count matches the forward's, as checkpoint requires). Selective
recomputation checkpoints the attention core inside the block; dynamo traces the checkpoint as a
region to recompute within the compiled graph.

The zero-bubble split backward (mini3d.pp.split_backward) defers the weight gradients of the
linear layers it sees (mini3d.wgrad); inside a compiled graph the linears are plain F.linear and the
backward of a compiled piece is one autograd node, so B computes that piece's weight gradients
too and holds them until W accumulates them: exact (tests/test_compile.py checks zb-h1 and zbv),
but for the compiled blocks B costs a whole backward and W only the accumulation.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from mini3d.config import COMPILE as BACKENDS
from mini3d.graph_breaks import keep_outside  # Plan.compile: "none", or the torch.compile backend


def apply_compile(model: nn.Module, plan) -> nn.Module:
    """Compile, in place, the forward of every transformer block of a mini3d GPT (or pipeline
    stage) with `torch.compile(backend=plan.compile)`; "none" leaves the model as it is. Call
    before `apply_recompute` (see the module docstring); names and parameters are unchanged."""
    if plan.compile not in BACKENDS:
        raise ValueError(f"compile={plan.compile!r} is unknown (choose {', '.join(BACKENDS)})")
    if plan.compile == "none":
        return model
    keep_outside()
    for block in getattr(model, "blocks", {}).values():
        if not getattr(block.forward, "compiled", False):
            block.forward = torch.compile(block.forward, backend=plan.compile)
            block.forward.compiled = True
    return model


__all__ = ["BACKENDS", "apply_compile"]
