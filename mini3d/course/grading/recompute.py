"""Checks of the exercise recompute (chapter 07): loss and gradients unchanged, and what each policy
keeps for backward, counted while the code runs (attention-core calls, projection calls,
saved-tensor bytes).

Selective recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models") reruns only the attention core (QK^T, softmax, dropout, times V), whose
activations grow with T^2 but cost few FLOPs; the qkv and output projections are not rerun. So
checkpointing the whole attention module is not "selective": its projections run twice.
"""

from __future__ import annotations

import torch

from mini3d.config import ModelConfig
from mini3d.course.grading.core import Check, Exercise, expect


def _recompute_run(ctx, policy):
    """Loss, grads, attention-core calls, bytes saved for backward, and attention-projection calls
    (qkv and output Linear) of one step under `policy`."""
    from mini3d.models.attention import attention_core
    from mini3d.models.transformer import GPT

    cfg = ModelConfig(2, 16, 2, 32, 16)
    seed = ctx.rng.randint(0, 10**6)
    model = GPT(cfg, seed)
    calls = [0]

    def counting_core(q, k, v):
        calls[0] += 1
        return attention_core(q, k, v)

    projections = [0]

    def count_projection(module, args, out):
        projections[0] += 1

    for b in model.blocks.values():
        b.attn.core = counting_core
        for lin in (b.attn.qkv, b.attn.proj):
            lin.register_forward_hook(count_projection)
    model = ctx.impl.apply_recompute(model, policy) or model
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 32, (2, 12), generator=g), torch.randint(0, 32, (2, 12), generator=g)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, calls[0], saved[0], projections[0]


def _recompute_all(ctx):
    return {p: _recompute_run(ctx, p) for p in ("none", "selective", "full")}


def same_grads(ctx):
    runs = _recompute_all(ctx)
    base = runs["none"]
    for policy in ("selective", "full"):
        loss, grads = runs[policy][:2]
        expect(abs(loss - base[0]) < 1e-6, f"loss under {policy!r}", base[0], loss)
        for n, g in grads.items():
            # recomputation replays the same float32 ops, so results agree to rounding
            err = (g - base[1][n]).abs().max().item()
            expect(err < 1e-6, f"gradient of {n} under {policy!r}", "the same as without recompute",
                   f"max difference {err:.3g}")


def selective_recomputes_core(ctx):
    runs = _recompute_all(ctx)
    n = 2  # layers
    expect(runs["none"][2] == n, "attention-core calls without recompute", n, runs["none"][2])
    expect(runs["selective"][2] == 2 * n, "attention-core calls with 'selective' (forward + recompute)",
           2 * n, runs["selective"][2])
    expect(runs["selective"][4] == 2 * n, "attention projection calls (qkv and output Linear) with "
           "'selective'", f"{2 * n}, as without recompute: only the core (QK^T, softmax, times V) is "
           f"rerun, never the projections (checkpoint block.attn.core, not the attention module)",
           runs["selective"][4])
    expect(runs["selective"][3] < runs["none"][3], "bytes saved for backward with 'selective'",
           f"fewer than without recompute ({runs['none'][3]})", runs["selective"][3])


def full_saves_least(ctx):
    runs = _recompute_all(ctx)
    expect(runs["full"][3] < runs["selective"][3], "bytes saved for backward with 'full'",
           f"fewer than with 'selective' ({runs['selective'][3]})", runs["full"][3])
    expect(runs["full"][2] == 4, "attention-core calls with 'full' (each block runs twice)", 4, runs["full"][2])


EXERCISES = [
    Exercise("recompute", "07 recomputation", [
        Check("same_grads", 2, same_grads, "loss and every gradient unchanged"),
        Check("selective", 2, selective_recomputes_core, "selective reruns only the attention core"),
        Check("full", 2, full_saves_least, "full keeps the least for backward"),
    ]),
]
